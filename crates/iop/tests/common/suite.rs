//! A suite of cases that share one expensive setup (the conformance suite's real server):
//! the cases run one after another, each in its own task, so a failed case does not stop
//! the rest; the suite ends with one summary line on stderr and fails if any case did.

use std::future::Future;
use std::io::Write;

/// Writes one line to the test process's stderr, past libtest's output capture.
pub fn notice(line: &str) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{line}");
}

/// Outcomes of a suite's cases.
pub struct Report {
    suite: String,
    passed: Vec<String>,
    failed: Vec<(String, String)>,
}

impl Report {
    pub fn new(suite: &str) -> Report {
        Report {
            suite: suite.to_string(),
            passed: Vec::new(),
            failed: Vec::new(),
        }
    }

    /// Runs one case in its own task, so a panic fails that case only.
    pub async fn run<F>(&mut self, case: &str, body: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        notice(&format!("{}: {case} ...", self.suite));
        match tokio::spawn(body).await {
            Ok(()) => self.passed.push(case.to_string()),
            Err(e) => {
                let message = match e.try_into_panic() {
                    Ok(p) => p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "a panic without a message".into()),
                    Err(e) => e.to_string(),
                };
                notice(&format!("{}: FAILED {case}: {message}", self.suite));
                self.failed.push((case.to_string(), message));
            }
        }
    }

    pub fn has_failures(&self) -> bool {
        !self.failed.is_empty()
    }

    /// Prints the summary; panics if a case failed.
    pub fn finish(self) {
        notice(&format!(
            "{}: {} passed, {} failed",
            self.suite,
            self.passed.len(),
            self.failed.len()
        ));
        let failed: Vec<String> = self
            .failed
            .iter()
            .map(|(case, message)| format!("{case}: {message}"))
            .collect();
        assert!(
            failed.is_empty(),
            "{}: {} case(s) failed:\n{}",
            self.suite,
            failed.len(),
            failed.join("\n\n")
        );
    }
}
