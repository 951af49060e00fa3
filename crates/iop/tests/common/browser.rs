//! A headless Chromium driven over the DevTools protocol, for tests of the status page.
//!
//! Chromium is started with `--remote-debugging-pipe`: it reads protocol messages from fd 3
//! and writes its answers and events to fd 4, each a JSON text ended by a NUL byte, so no
//! port, websocket or client crate is needed. A thread reads fd 4: answers go to the call
//! waiting for their id, events are kept so a test can look for console errors.
//!
//! [`Browser::launch`] finds `chromium` (or `IOP_CHROMIUM`); without one it returns `None`
//! and the test skips, unless `IOP_REQUIRE_BROWSER=1` makes that a failure.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::sync::oneshot;

/// Longest wait for one protocol answer.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Value>>>>;

/// A running headless Chromium.
pub struct Browser {
    child: Child,
    to_browser: Mutex<std::io::PipeWriter>,
    pending: Pending,
    events: Arc<Mutex<Vec<Value>>>,
    stderr: Arc<Mutex<Vec<String>>>,
    next_id: AtomicU64,
    _profile: tempfile::TempDir,
}

/// One tab, attached with its own protocol session.
pub struct Page<'a> {
    browser: &'a Browser,
    session: String,
}

/// The Chromium to use: `IOP_CHROMIUM`, or the first of the usual names on `PATH`.
fn find_chromium() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("IOP_CHROMIUM") {
        return Some(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH")?;
    [
        "chromium",
        "chromium-browser",
        "google-chrome-stable",
        "google-chrome",
    ]
    .iter()
    .flat_map(|name| std::env::split_paths(&path).map(move |dir| dir.join(name)))
    .find(|candidate| candidate.is_file())
}

/// A duplicate of `fd` numbered 10 or above (close-on-exec), so that the child's `dup2`
/// onto 3 and 4 cannot overwrite the other one.
fn high_fd(fd: impl AsFd) -> OwnedFd {
    use std::os::fd::FromRawFd;
    let raw = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(10))
        .expect("duplicate a pipe descriptor");
    // SAFETY: fcntl returned a new descriptor that nothing else owns.
    unsafe { OwnedFd::from_raw_fd(raw) }
}

impl Browser {
    /// Starts Chromium with a `width`×`height` window; `None` (after saying why) when
    /// there is none and `IOP_REQUIRE_BROWSER` is not set.
    pub fn launch(width: u32, height: u32) -> Option<Browser> {
        let Some(binary) = find_chromium() else {
            if std::env::var("IOP_REQUIRE_BROWSER").is_ok_and(|v| v == "1") {
                panic!(
                    "IOP_REQUIRE_BROWSER=1 but no Chromium found: install it (`apt-get install chromium`) or set IOP_CHROMIUM"
                );
            }
            eprintln!(
                "SKIPPED: no Chromium found (install `chromium` or set IOP_CHROMIUM; IOP_REQUIRE_BROWSER=1 makes this a failure)"
            );
            return None;
        };
        let profile = tempfile::tempdir().unwrap();
        let (commands_read, commands_write) = std::io::pipe().unwrap();
        let (answers_read, answers_write) = std::io::pipe().unwrap();
        let (child_in, child_out) = (high_fd(&commands_read), high_fd(&answers_write));
        drop((commands_read, answers_write));
        let (fd_in, fd_out) = (child_in.as_raw_fd(), child_out.as_raw_fd());
        let mut command = Command::new(&binary);
        command
            .args([
                "--headless=new",
                // Tests run as root in containers, where Chromium's sandbox cannot start;
                // the browser only ever loads the test edge on loopback.
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--remote-debugging-pipe",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-proxy-server",
                "--hide-scrollbars",
                "--mute-audio",
                &format!("--window-size={width},{height}"),
                &format!("--user-data-dir={}", profile.path().display()),
                "about:blank",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // SAFETY: only dup2, which is async-signal-safe, runs between fork and exec.
        unsafe {
            command.pre_exec(move || {
                for (from, to) in [(fd_in, 3), (fd_out, 4)] {
                    if nix::libc::dup2(from, to) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", binary.display()));
        drop((child_in, child_out));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        {
            let stderr = stderr.clone();
            let pipe = child.stderr.take().unwrap();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    stderr.lock().unwrap().push(line);
                }
            });
        }
        let pending: Pending = Arc::default();
        let events = Arc::new(Mutex::new(Vec::new()));
        {
            let (pending, events) = (pending.clone(), events.clone());
            std::thread::spawn(move || {
                let mut reader = BufReader::new(answers_read);
                let mut message = Vec::new();
                loop {
                    message.clear();
                    match reader.read_until(0, &mut message) {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {}
                    }
                    if message.last() == Some(&0) {
                        message.pop();
                    }
                    let Ok(value) = serde_json::from_slice::<Value>(&message) else {
                        continue;
                    };
                    match value["id"].as_u64() {
                        Some(id) => {
                            if let Some(tx) = pending.lock().unwrap().remove(&id) {
                                let _ = tx.send(value);
                            }
                        }
                        None => events.lock().unwrap().push(value),
                    }
                }
            });
        }
        Some(Browser {
            child,
            to_browser: Mutex::new(commands_write),
            pending,
            events,
            stderr,
            next_id: AtomicU64::new(1),
            _profile: profile,
        })
    }

    /// Sends one protocol command (to the tab of `session`, or the browser) and returns its
    /// result; panics on a protocol error or after [`CALL_TIMEOUT`].
    async fn send(&self, session: Option<&str>, method: &str, params: Value) -> Value {
        self.try_send(session, method, params, CALL_TIMEOUT)
            .await
            .unwrap_or_else(|| panic!("{method}: no answer within {CALL_TIMEOUT:?}"))
    }

    /// [`Self::send`] that gives up after `within` (`None`) instead of panicking.
    async fn try_send(
        &self,
        session: Option<&str>,
        method: &str,
        params: Value,
        within: Duration,
    ) -> Option<Value> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut message = json!({"id": id, "method": method, "params": params});
        if let Some(session) = session {
            message["sessionId"] = json!(session);
        }
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap().insert(id, tx);
        {
            let mut pipe = self.to_browser.lock().unwrap();
            let mut bytes = serde_json::to_vec(&message).unwrap();
            bytes.push(0);
            pipe.write_all(&bytes)
                .unwrap_or_else(|e| panic!("{method}: the browser is gone: {e}"));
        }
        let Ok(answer) = tokio::time::timeout(within, rx).await else {
            self.pending.lock().unwrap().remove(&id);
            return None;
        };
        let answer = answer.unwrap_or_else(|_| panic!("{method}: the browser closed the pipe"));
        if let Some(error) = answer.get("error") {
            panic!("{method}: {error}");
        }
        Some(answer["result"].clone())
    }

    /// Waits until the browser answers on its pipe. A busy machine may take long to start
    /// Chromium, and a command written while it is still starting can go unanswered, so
    /// the question is asked again every few seconds (for up to two minutes).
    async fn wait_answering(&self) {
        for _ in 0..24 {
            let asked = self.try_send(
                None,
                "Browser.getVersion",
                json!({}),
                Duration::from_secs(5),
            );
            if asked.await.is_some() {
                return;
            }
        }
        panic!(
            "Chromium did not answer on its DevTools pipe within 2 minutes; its stderr:\n{}",
            self.stderr()
        );
    }

    /// Opens a tab of `width`×`height` CSS pixels with console and log collection on.
    pub async fn new_page(&self, width: u32, height: u32) -> Page<'_> {
        self.wait_answering().await;
        let target = self
            .send(None, "Target.createTarget", json!({"url": "about:blank"}))
            .await;
        let attached = self
            .send(
                None,
                "Target.attachToTarget",
                json!({"targetId": target["targetId"], "flatten": true}),
            )
            .await;
        let page = Page {
            browser: self,
            session: attached["sessionId"].as_str().unwrap().to_string(),
        };
        for domain in ["Runtime.enable", "Log.enable", "Page.enable"] {
            page.call(domain, json!({})).await;
        }
        page.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": width, "height": height, "deviceScaleFactor": 1, "mobile": false}),
        )
        .await;
        page
    }

    /// Every console error, uncaught exception and error-level log entry (failed loads,
    /// CSP violations) the browser reported so far.
    pub fn console_errors(&self) -> Vec<String> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| {
                let p = &e["params"];
                match e["method"].as_str()? {
                    "Runtime.consoleAPICalled"
                        if matches!(p["type"].as_str(), Some("error" | "assert")) =>
                    {
                        Some(format!("console.{}: {}", p["type"], p["args"]))
                    }
                    "Runtime.exceptionThrown" => {
                        Some(format!("exception: {}", p["exceptionDetails"]))
                    }
                    "Log.entryAdded" if p["entry"]["level"] == "error" => Some(format!(
                        "log ({}): {} {}",
                        p["entry"]["source"], p["entry"]["text"], p["entry"]["url"]
                    )),
                    _ => None,
                }
            })
            .collect()
    }

    /// The browser's own output (for a failing test's report).
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "----- browser events -----\n{}\n-----",
                self.events
                    .lock()
                    .unwrap()
                    .iter()
                    .map(Value::to_string)
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    }
}

impl Page<'_> {
    /// Sends a protocol command to this tab.
    pub async fn call(&self, method: &str, params: Value) -> Value {
        self.browser.send(Some(&self.session), method, params).await
    }

    /// Loads `url` and waits until its document has loaded.
    pub async fn navigate(&self, url: &str) {
        self.call("Page.navigate", json!({"url": url})).await;
        self.wait_for(
            "document.readyState === 'complete' && location.href !== 'about:blank'",
            Duration::from_secs(20),
            "the page to load",
        )
        .await;
    }

    /// The value of the JavaScript `expression` (awaited if it is a promise).
    pub async fn eval(&self, expression: &str) -> Value {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
            )
            .await;
        if let Some(details) = result.get("exceptionDetails") {
            panic!("{expression}: {details}");
        }
        result["result"]["value"].clone()
    }

    /// Evaluates `expression` until it is truthy; returns its value and how long that took.
    pub async fn wait_for(&self, expression: &str, within: Duration, what: &str) -> Value {
        let started = Instant::now();
        loop {
            let value = self.eval(expression).await;
            let truthy = match &value {
                Value::Null => false,
                Value::Bool(b) => *b,
                Value::Number(n) => n.as_f64() != Some(0.0),
                Value::String(s) => !s.is_empty(),
                _ => true,
            };
            if truthy {
                return value;
            }
            if started.elapsed() > within {
                let text = self.eval("document.body.innerText").await;
                panic!("the page never showed {what} within {within:?}; it shows:\n{text}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A PNG of the whole page (as wide as the window, as tall as the content).
    pub async fn screenshot(&self) -> Vec<u8> {
        use base64::Engine;
        let height = self
            .eval("Math.ceil(document.documentElement.scrollHeight)")
            .await
            .as_f64()
            .unwrap_or(800.0);
        let width = self
            .eval("document.documentElement.clientWidth")
            .await
            .as_f64()
            .unwrap_or(1280.0);
        let shot = self
            .call(
                "Page.captureScreenshot",
                json!({
                    "format": "png",
                    "captureBeyondViewport": true,
                    "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
                }),
            )
            .await;
        base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap())
            .unwrap()
    }
}
