//! The code's shape, checked on every test run: within each crate no two modules depend on
//! each other (directly or around a loop of siblings), nor a module and its child (the
//! parent composes its children; what they share lives in a child); no crate reaches
//! what it must not (the pure crates no runtime, server or database; a daemon neither the
//! other nor the mock server); the edge's layers below its service name none above it;
//! and no function on the request path is longer than a reader can hold (100 lines), nor
//! one elsewhere without saying why. Test code is left out.
//!
//! A module depends on another when its code names a path into it (`crate::a::b`,
//! `super::b`, a child's `b::c`, a `use` of any, in code or in a macro's arguments); a
//! dependency on a module's descendant counts as one on the sibling that contains it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// The longest function allowed on the request path, in lines.
const MAX_FUNCTION_LINES: usize = 100;

/// The request path: every surface, codec and service module of the edge, and the node's
/// run and tunnel execution with its adapters and usage readers.
const REQUEST_PATH: &[&str] = &[
    "iop-api/src",
    "iop-edge/src/service",
    "iop-edge/src/http",
    "iop-node/src/runs.rs",
    "iop-node/src/tunnel.rs",
    "iop-node/src/run_outlet.rs",
    "iop-node/src/stream.rs",
    "iop-adapters/src",
];

const CRATES: &[&str] = &[
    "iop-proto",
    "iop-api",
    "iop-edge-config",
    "iop-core",
    "iop-fleet",
    "iop-edge",
    "iop-adapters",
    "iop-node",
    "iop-mock-model",
    "iop-mock",
    "iop",
];

fn crates_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crates/")
        .to_path_buf()
}

/// Every module file of a crate's `src`, by module path (`service::dispatch`), test files
/// left out.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                if path.file_name().unwrap() != "tests" {
                    dirs.push(path);
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(
                parts.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                parts.pop();
            }
            if parts.iter().any(|p| p == "tests" || p.ends_with("_tests")) {
                continue;
            }
            out.insert(parts.join("::"), path);
        }
    }
    out
}

/// `#[cfg(test)]`, `#[test]` or `#[tokio::test]`.
fn is_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| match &a.meta {
        syn::Meta::List(list) => list.path.is_ident("cfg") && list.tokens.to_string() == "test",
        syn::Meta::Path(path) => path.segments.last().is_some_and(|s| s.ident == "test"),
        syn::Meta::NameValue(_) => false,
    })
}

/// What one file names and how long its functions are.
#[derive(Default)]
struct FileVisitor {
    /// Paths starting at `crate`, `super` or `self`, and other paths of two segments or
    /// more (which may start at a child module), as segments.
    paths: Vec<Vec<String>>,
    /// (function name, first line, lines) of every non-test function.
    functions: Vec<(String, usize, usize)>,
}

impl FileVisitor {
    fn use_tree(&mut self, prefix: Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                let mut prefix = prefix;
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
            }
            syn::UseTree::Name(n) => {
                let mut path = prefix;
                path.push(n.ident.to_string());
                self.paths.push(path);
            }
            syn::UseTree::Rename(r) => {
                let mut path = prefix;
                path.push(r.ident.to_string());
                self.paths.push(path);
            }
            syn::UseTree::Glob(_) => self.paths.push(prefix),
            syn::UseTree::Group(g) => {
                for tree in &g.items {
                    self.use_tree(prefix.clone(), tree);
                }
            }
        }
    }

    /// A function from its signature to the end of its body (doc comments not counted).
    fn function(&mut self, sig: &syn::Signature, body: &syn::Block) {
        use syn::spanned::Spanned;
        let (start, end) = (sig.span().start().line, body.span().end().line);
        self.functions
            .push((sig.ident.to_string(), start, end.saturating_sub(start) + 1));
    }
}

impl<'ast> Visit<'ast> for FileVisitor {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let attrs = match item {
            syn::Item::Mod(m) => &m.attrs,
            syn::Item::Fn(f) => &f.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Use(u) => &u.attrs,
            _ => return syn::visit::visit_item(self, item),
        };
        if !is_test(attrs) {
            syn::visit::visit_item(self, item);
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        self.use_tree(Vec::new(), &item.tree);
    }

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        self.function(&f.sig, &f.block);
        syn::visit::visit_item_fn(self, f);
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if is_test(&f.attrs) {
            return;
        }
        self.function(&f.sig, &f.block);
        syn::visit::visit_impl_item_fn(self, f);
    }

    /// A macro's arguments are tokens to syn, not code: the paths in them are read from
    /// the tokens (`crate::a::b` inside `format!`, `tracing::info!`, `json!`…).
    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.paths.extend(token_paths(mac.tokens.clone()));
        syn::visit::visit_macro(self, mac);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        // `crate::…`, `super::…`, `self::…`, or a bare `child::…` (resolved later: only a
        // child module of the file's own counts).
        if segments.len() > 1
            || segments
                .first()
                .is_some_and(|s| s == "crate" || s == "super" || s == "self")
        {
            self.paths.push(segments);
        }
        syn::visit::visit_path(self, path);
    }

    /// `pub(super)` and `pub(in crate::a)` say who may see an item, not what it uses.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}
}

/// The paths starting at `crate`, `super` or `self` in a token stream, groups included.
fn token_paths(tokens: proc_macro2::TokenStream) -> Vec<Vec<String>> {
    use proc_macro2::TokenTree;
    let mut found = Vec::new();
    let mut current: Vec<String> = Vec::new();
    // Whether the last tokens were `::` after a segment of `current`.
    let mut colons = 0;
    let end = |current: &mut Vec<String>, found: &mut Vec<Vec<String>>| {
        if current.len() > 1 {
            found.push(std::mem::take(current));
        }
        current.clear();
    };
    for token in tokens {
        match token {
            TokenTree::Ident(ident) => {
                let name = ident.to_string();
                if !current.is_empty() && colons == 2 {
                    current.push(name);
                } else {
                    end(&mut current, &mut found);
                    if name == "crate" || name == "super" || name == "self" {
                        current.push(name);
                    }
                }
                colons = 0;
            }
            TokenTree::Punct(p) if p.as_char() == ':' && !current.is_empty() => colons += 1,
            TokenTree::Group(group) => {
                end(&mut current, &mut found);
                found.extend(token_paths(group.stream()));
                colons = 0;
            }
            _ => {
                end(&mut current, &mut found);
                colons = 0;
            }
        }
    }
    end(&mut current, &mut found);
    found
}

fn visit(file: &Path) -> FileVisitor {
    let text = std::fs::read_to_string(file).unwrap();
    let ast = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let mut visitor = FileVisitor::default();
    visitor.visit_file(&ast);
    visitor
}

/// The module a path names, from module `at`: the longest known prefix.
fn resolve(modules: &BTreeMap<String, PathBuf>, at: &str, path: &[String]) -> Option<String> {
    let mut base: Vec<&str> = if at.is_empty() {
        Vec::new()
    } else {
        at.split("::").collect()
    };
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        Some("super") => {
            while rest.first().is_some_and(|s| s == "super") {
                base.pop();
                rest = &rest[1..];
            }
        }
        Some(first) => {
            // A bare path starts at a child of `at` (`mod dispatch;` then `dispatch::run`),
            // or names something else in scope (a crate, a local item): not a module here.
            let child = if at.is_empty() {
                first.to_string()
            } else {
                format!("{at}::{first}")
            };
            if !modules.contains_key(&child) {
                return None;
            }
        }
        None => return None,
    }
    let full: Vec<&str> = base
        .into_iter()
        .chain(rest.iter().map(String::as_str))
        .collect();
    (1..=full.len())
        .rev()
        .map(|n| full[..n].join("::"))
        .find(|m| modules.contains_key(m))
}

/// The child of `parent` that `module` is or lies in.
fn child_of(parent: &str, module: &str) -> Option<String> {
    let parent: Vec<&str> = if parent.is_empty() {
        Vec::new()
    } else {
        parent.split("::").collect()
    };
    let module: Vec<&str> = module.split("::").collect();
    (module.len() > parent.len() && module[..parent.len()] == parent[..])
        .then(|| module[..=parent.len()].join("::"))
}

/// The loops among `graph`'s nodes (strongly connected components of two or more).
fn loops(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let reaches = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.to_string()];
        while let Some(n) = stack.pop() {
            for next in graph.get(&n).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    stack.push(next.clone());
                }
            }
        }
        seen
    };
    let mut found: Vec<Vec<String>> = Vec::new();
    for node in graph.keys() {
        let forward = reaches(node);
        if !forward.contains(node) || found.iter().any(|l| l.contains(node)) {
            continue;
        }
        let component: Vec<String> = forward
            .into_iter()
            .filter(|other| reaches(other).contains(node))
            .collect();
        found.push(component);
    }
    found
}

/// Which modules of `krate` each of its modules names.
fn dependencies(
    krate: &str,
) -> (
    BTreeMap<String, PathBuf>,
    BTreeMap<String, BTreeSet<String>>,
) {
    let src = crates_dir().join(krate).join("src");
    let modules = modules(&src);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, file) in &modules {
        for path in visit(file).paths {
            if let Some(target) = resolve(&modules, module, &path)
                && &target != module
            {
                edges.entry(module.clone()).or_default().insert(target);
            }
        }
    }
    (modules, edges)
}

/// The edge's layers below its service (state it keeps, files and the store it writes,
/// what it renders for the APIs), and the layers above (the service that decides and
/// dispatches, the HTTP and node transports that move bytes to and from it): a layer
/// below never names one above, so each can be read and tested without them. (The core
/// state machines, the codecs, the config and the fleet's store are crates of their own
/// below the edge.)
const EDGE_BELOW: &[&str] = &[
    "ledger",
    "trust",
    "session",
    "metrics",
    "events",
    "catalog",
    "payload",
    "local_models",
    "drain",
    "pem",
    "status",
];
const EDGE_ABOVE: &[&str] = &["service", "http", "transport"];

/// Whether `module` is `top` or lies in it.
fn within(module: &str, top: &str) -> bool {
    module == top || module.starts_with(&format!("{top}::"))
}

/// The dependencies of `edges` from a module within `from` to one within `to`.
fn crossings(
    edges: &BTreeMap<String, BTreeSet<String>>,
    from: &[&str],
    to: &[&str],
) -> Vec<String> {
    let mut found = Vec::new();
    for (module, targets) in edges {
        if !from.iter().any(|f| within(module, f)) {
            continue;
        }
        for target in targets {
            if to.iter().any(|t| within(target, t)) {
                found.push(format!("{module} -> {target}"));
            }
        }
    }
    found
}

#[test]
fn the_layers_below_the_service_name_none_above() {
    let (_, edges) = dependencies("iop-edge");
    let found = crossings(&edges, EDGE_BELOW, EDGE_ABOVE);
    assert!(
        found.is_empty(),
        "edge layers below the service that name one above it (move what they need down, \
         or pass it in):\n{}",
        found.join("\n")
    );
}

#[test]
fn no_two_modules_of_a_crate_depend_on_each_other() {
    let mut problems = Vec::new();
    for krate in CRATES {
        let (modules, edges) = dependencies(krate);
        // Every module, the crate root ("") included.
        for parent in modules.keys() {
            let mut siblings: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
            for (from, targets) in &edges {
                let Some(a) = child_of(parent, from) else {
                    continue;
                };
                for to in targets {
                    if let Some(b) = child_of(parent, to)
                        && a != b
                    {
                        siblings.entry(a.clone()).or_default().insert(b);
                    }
                }
            }
            for cycle in loops(&siblings) {
                problems.push(format!("{krate}: {}", cycle.join(" <-> ")));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "modules that depend on each other (move what both need into one of them, or into \
         a module of its own):\n{}",
        problems.join("\n")
    );
}

/// The loops between a module and one of its children in `edges`: the parent's own file
/// names the child (or something in it) and the child, or a module in it, names something
/// the parent's own file defines or re-exports. A parent composes its children; what
/// they share lives in a child of its own. (A crate root's items are not resolved: it
/// holds the crate's names for other crates, which every module may use.)
fn parent_child_loops(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut found = BTreeSet::new();
    for (parent, named) in edges {
        for (from, targets) in edges {
            let Some(child) = child_of(parent, from) else {
                continue;
            };
            if targets.contains(parent) && named.iter().any(|n| within(n, &child)) {
                found.insert(format!("{parent} <-> {child} (from {from})"));
            }
        }
    }
    found.into_iter().collect()
}

#[test]
fn no_module_and_its_child_depend_on_each_other() {
    let mut problems = Vec::new();
    for krate in CRATES {
        let (_, edges) = dependencies(krate);
        for found in parent_child_loops(&edges) {
            problems.push(format!("{krate}: {found}"));
        }
    }
    assert!(
        problems.is_empty(),
        "a module and its child that name each other (move what the child needs from its \
         parent into a child of its own):\n{}",
        problems.join("\n")
    );
}

/// What a function over [`MAX_FUNCTION_LINES`] off the request path says, in a comment
/// right above it, followed by why it reads better whole.
const LONG_REASON: &str = "Over 100 lines:";

/// Whether the comments and attributes right above line `line` (1-based) of `text` give
/// a [`LONG_REASON`].
fn long_reason_above(text: &str, line: usize) -> bool {
    text.lines()
        .take(line.saturating_sub(1))
        .collect::<Vec<_>>()
        .iter()
        .rev()
        .map(|l| l.trim())
        .take_while(|l| l.starts_with("//") || l.starts_with("#["))
        .any(|l| l.contains(LONG_REASON))
}

/// Every function of every crate's non-test code over [`MAX_FUNCTION_LINES`]:
/// (`crate/src/file:line name (n lines)`, on the request path, with a reason).
fn long_functions() -> Vec<(String, bool, bool)> {
    let mut long = Vec::new();
    for krate in CRATES {
        let src = crates_dir().join(krate).join("src");
        for file in modules(&src).values() {
            let rel = file.strip_prefix(crates_dir()).unwrap().to_string_lossy();
            let on_request_path = REQUEST_PATH.iter().any(|p| rel.starts_with(p));
            let text = std::fs::read_to_string(file).unwrap();
            for (name, line, lines) in visit(file).functions {
                if lines > MAX_FUNCTION_LINES {
                    long.push((
                        format!("{rel}:{line} {name} ({lines} lines)"),
                        on_request_path,
                        long_reason_above(&text, line),
                    ));
                }
            }
        }
    }
    long
}

#[test]
fn no_function_on_the_request_path_is_over_100_lines() {
    let long: Vec<String> = long_functions()
        .into_iter()
        .filter(|(_, on_request_path, _)| *on_request_path)
        .map(|(f, _, _)| f)
        .collect();
    assert!(
        long.is_empty(),
        "functions on the request path over {MAX_FUNCTION_LINES} lines:\n{}",
        long.join("\n")
    );
}

#[test]
fn a_function_over_100_lines_elsewhere_says_why() {
    let mut justified = Vec::new();
    let mut unexplained = Vec::new();
    for (function, on_request_path, reason) in long_functions() {
        match (on_request_path, reason) {
            (true, _) => {}
            (false, true) => justified.push(function),
            (false, false) => unexplained.push(function),
        }
    }
    eprintln!(
        "functions over {MAX_FUNCTION_LINES} lines, each with its reason:\n{}",
        justified.join("\n")
    );
    assert!(
        unexplained.is_empty(),
        "functions over {MAX_FUNCTION_LINES} lines with no `// {LONG_REASON} <why>` above \
         them (split them, or say why they read better whole):\n{}",
        unexplained.join("\n")
    );
}

/// A module graph from `(module, [what it names])` pairs, for the checks' own tests.
fn graph_of(pairs: &[(&str, &[&str])]) -> BTreeMap<String, BTreeSet<String>> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.iter().map(|s| s.to_string()).collect()))
        .collect()
}

#[test]
fn the_checks_see_a_loop_and_a_long_function() {
    let graph = graph_of(&[
        ("a", &["b"][..]),
        ("b", &["c"][..]),
        ("c", &["a"][..]),
        ("d", &["a"][..]),
    ]);
    assert_eq!(loops(&graph), vec![vec!["a", "b", "c"]]);
    // A parent that names its child, which names the parent's own items back: a loop
    // (also through a grandchild); a child naming its sibling, or its parent alone, not.
    let graph = graph_of(&[
        ("queue", &["queue::state", "lease"][..]),
        ("queue::state", &["queue"][..]),
        ("queue::spec", &["queue"][..]),
        ("http", &["http::admin::usage"][..]),
        ("http::admin::usage", &["http"][..]),
        ("ledger", &["ledger::record"][..]),
        ("ledger::record", &["ledger::writer"][..]),
    ]);
    assert_eq!(
        parent_child_loops(&graph),
        [
            "http <-> http::admin (from http::admin::usage)",
            "queue <-> queue::state (from queue::state)",
        ]
    );
    let modules: BTreeMap<String, PathBuf> = ["queue", "queue::state", "lease"]
        .into_iter()
        .map(|m| (m.to_string(), PathBuf::new()))
        .collect();
    let path = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        resolve(&modules, "queue", &path(&["state", "Scheduler"])).as_deref(),
        Some("queue::state")
    );
    assert_eq!(
        resolve(&modules, "queue", &path(&["tracing", "info"])),
        None
    );
    assert_eq!(
        resolve(&modules, "queue::state", &path(&["lease", "X"])),
        None
    );
    let body = "    let x = 1;\n".repeat(MAX_FUNCTION_LINES);
    let ast = syn::parse_file(&format!("fn long() {{\n{body}}}\n")).unwrap();
    let mut v = FileVisitor::default();
    v.visit_file(&ast);
    assert_eq!(
        v.functions,
        vec![("long".to_string(), 1, MAX_FUNCTION_LINES + 2)]
    );
}

#[test]
fn the_checks_see_paths_in_macros_and_a_forbidden_direction() {
    let file = syn::parse_file(
        "pub(super) fn f() { tracing::info!(x = %crate::a::b(1), \"{}\", super::super::c::D); \
         let s = self.x; child::g(s); }",
    )
    .unwrap();
    let mut visitor = FileVisitor::default();
    visitor.visit_file(&file);
    // `pub(super)` names no dependency; `tracing::info` and `child::g` are kept for
    // `resolve`, which finds only the child module of the file's own.
    let want: Vec<Vec<String>> = [
        &["crate", "a", "b"][..],
        &["super", "super", "c", "D"][..],
        &["tracing", "info"][..],
        &["child", "g"][..],
    ]
    .iter()
    .map(|p| p.iter().map(|s| s.to_string()).collect())
    .collect();
    let text = "// Over 100 lines: a table\n/// Doc.\n#[inline]\nfn a() {}\n\n// Over 100 lines: x\n\nfn b() {}\n";
    assert!(
        long_reason_above(text, 4),
        "a reason above the docs and attributes counts"
    );
    assert!(
        !long_reason_above(text, 8),
        "one a blank line away does not"
    );
    // (`self.x` is the path `self`, the module itself: no dependency.)
    let named: Vec<Vec<String>> = visitor.paths.into_iter().filter(|p| p.len() > 1).collect();
    assert_eq!(named, want);

    let edges = graph_of(&[
        ("queue::tests", &["service::x"][..]),
        ("queue", &["lease"][..]),
        ("service", &["queue"][..]),
    ]);
    assert_eq!(
        crossings(&edges, &["queue"], &["service"]),
        ["queue::tests -> service::x"]
    );
}

/// What each crate may never reach, directly or through another crate (normal
/// dependencies, its default features): the pure layers no async runtime, HTTP server or
/// database; the fleet's store no HTTP server, SQLite or daemon; the node's adapters
/// neither daemon, the mock server nor the node's SQLite; a daemon neither the other
/// daemon nor the mock server.
const NEVER_REACHES: &[(&str, &[&str])] = &[
    ("iop-api", IO_CRATES),
    ("iop-core", IO_CRATES),
    ("iop-mock-model", IO_CRATES),
    (
        "iop-fleet",
        &[
            "iop-edge", "iop-node", "iop-mock", "axum", "hyper", "rusqlite",
        ],
    ),
    ("iop-edge", &["iop-node", "iop-mock"]),
    ("iop-node", &["iop-edge", "iop-mock"]),
    (
        "iop-adapters",
        &["iop-edge", "iop-node", "iop-mock", "axum", "rusqlite"],
    ),
    (
        "iop-proto",
        &["iop-api", "iop-core", "iop-edge", "iop-node"],
    ),
];
const IO_CRATES: &[&str] = &["tokio", "axum", "hyper", "rusqlite", "tokio-postgres"];

/// The crates `tree` (`cargo tree --prefix none` output) lists.
fn tree_crates(tree: &str) -> BTreeSet<&str> {
    tree.lines()
        .filter_map(|line| line.split_whitespace().next())
        .collect()
}

#[test]
fn no_crate_reaches_what_it_must_not() {
    for (krate, never) in NEVER_REACHES {
        let output = std::process::Command::new(env!("CARGO"))
            .args([
                "tree",
                "--offline",
                "-e",
                "normal",
                "--prefix",
                "none",
                "-p",
                krate,
            ])
            .current_dir(crates_dir())
            .output()
            .expect("cargo tree");
        assert!(
            output.status.success(),
            "cargo tree -p {krate}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let tree = String::from_utf8_lossy(&output.stdout);
        let crates = tree_crates(&tree);
        assert!(crates.len() > 1, "{krate}: no dependencies listed:\n{tree}");
        let reached: Vec<&&str> = never.iter().filter(|n| crates.contains(**n)).collect();
        assert!(
            reached.is_empty(),
            "{krate} reaches {reached:?} (cargo tree -p {krate} -e normal -i <name> shows how)"
        );
    }
    let sample = "iop-core v0.1.0 (/x)\nserde v1.0.0\ntokio v1.0.0 (*)\n";
    assert!(tree_crates(sample).contains("tokio"));
}
