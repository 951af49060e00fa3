//! Helpers for the provider health tests: a mock provider restarted on the address it had,
//! its fault switches and request count, and a provider's health in the status snapshot.

use std::time::Duration;

use serde_json::Value;

use super::{EdgeProc, MockProc, Proc, client, provider_of, wait_status};

/// Starts `iop mock-provider` on `addr` (a restarted provider keeps its address).
pub async fn start_mock_on(addr: &str) -> MockProc {
    let proc = Proc::spawn("mock-provider", &["mock-provider", "--listen", addr]);
    proc.wait_line("iop mock-provider listening:", Duration::from_secs(20))
        .await;
    MockProc {
        proc,
        addr: addr.to_string(),
    }
}

/// Switches the mock's faults (`{"requests": bool, "health": bool}`).
pub async fn set_faults(mock: &MockProc, faults: Value) {
    let response = client()
        .post(format!("http://{}/mock/faults", mock.addr))
        .json(&faults)
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success());
}

/// Generation requests the mock received.
pub async fn requests(mock: &MockProc) -> u64 {
    mock.stats().await["requests"].as_u64().unwrap()
}

/// Waits until `node`/`provider` shows `health`; returns how long it took.
pub async fn wait_health(
    edge: &EdgeProc,
    node: &str,
    provider: &str,
    health: &str,
    within: Duration,
) -> Duration {
    wait_status(edge, within, &format!("{node}/{provider} {health}"), |s| {
        provider_of(s, node, provider)["health"] == health
    })
    .await
}
