//! Standard output for the commands that print: `println!` and `print!` in this crate
//! come here (see the macros in `main.rs`). A closed stdout — `iop status | head`,
//! `iop usage | true` — ends the process quietly with status 0, as a reader that has
//! seen enough expects, instead of a panic; any other write error is said once on stderr
//! and ends it with status 1.

use std::io::Write;

/// Writes `args` and a newline to stdout.
pub fn line(args: std::fmt::Arguments<'_>) {
    write(|out| writeln!(out, "{args}"));
}

/// Writes `args` to stdout.
pub fn text(args: std::fmt::Arguments<'_>) {
    write(|out| write!(out, "{args}"));
}

/// Writes `bytes` to stdout as they are.
pub fn bytes(bytes: &[u8]) {
    write(|out| out.write_all(bytes));
}

fn write(put: impl FnOnce(&mut std::io::StdoutLock<'static>) -> std::io::Result<()>) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = put(&mut out).and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("iop: cannot write to standard output: {e}");
        std::process::exit(1);
    }
}
