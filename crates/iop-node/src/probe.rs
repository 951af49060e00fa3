//! Active health checks: one task per adapter instance probes its provider, cheaply and in
//! the way its kind allows, feeds the result to the instance's [`ProbeTracker`], and bumps
//! the runtime's health counter when the settled health changes (the session then reports
//! it to the edge).
//!
//! - `vllm`: `GET <server root>/health` (the base URL without `/v1`);
//! - `openai_compat`: `GET <base_url>/models`;
//! - `ollama`: `GET <base_url>/api/version`;
//! - `cli`: the program exists and may be executed (nothing is run);
//! - `mock`: always healthy, never probed.
//!
//! Probes run on their own tasks with their own timeout, never take a capacity slot and
//! never touch the tunnel's connections, so they cannot slow the relay. A probe task ends
//! when its instance is dropped (a config change replaced it).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};

use iop_proto::pb;
use tokio::sync::watch;

use crate::adapters::HttpProvider;
use crate::health::{Health, ProbeTracker};
use crate::instance::AdapterInstance;
use crate::store::now_ms;

/// How a provider is probed.
#[derive(Debug, Clone)]
pub enum Probe {
    /// Needs no probe: healthy (the mock).
    Always,
    /// `GET url` must answer 2xx; `label` names the path in errors.
    Http {
        provider: Box<HttpProvider>,
        url: String,
        label: &'static str,
    },
    /// The program must exist and be executable.
    Program {
        program: String,
        /// `PATH` as the program would see it.
        search_path: Option<String>,
        working_dir: Option<PathBuf>,
    },
}

impl Probe {
    /// The probe for an adapter instance's kind.
    pub fn of(instance: &AdapterInstance) -> Probe {
        let spec = &instance.spec;
        match spec.kind() {
            pb::ProviderKind::Vllm | pb::ProviderKind::OpenaiCompat => {
                let Some(endpoint) = instance.adapter.tunnel() else {
                    return Probe::Always;
                };
                let provider = Box::new(endpoint.provider.clone());
                if spec.kind() == pb::ProviderKind::Vllm {
                    let url = format!("{}/health", provider.server_root());
                    Probe::Http {
                        provider,
                        url,
                        label: "/health",
                    }
                } else {
                    let url = provider.url("/models");
                    Probe::Http {
                        provider,
                        url,
                        label: "/models",
                    }
                }
            }
            pb::ProviderKind::Ollama => match instance.adapter.ollama() {
                Some(ollama) => Probe::Http {
                    url: ollama.provider.url("/api/version"),
                    provider: Box::new(ollama.provider.clone()),
                    label: "/api/version",
                },
                None => Probe::Always,
            },
            pb::ProviderKind::Cli => {
                let cli = spec.cli.clone().unwrap_or_default();
                Probe::Program {
                    program: cli.argv.first().cloned().unwrap_or_default(),
                    search_path: cli
                        .env
                        .get("PATH")
                        .cloned()
                        .or_else(|| std::env::var("PATH").ok()),
                    working_dir: (!cli.working_dir.is_empty())
                        .then(|| PathBuf::from(&cli.working_dir)),
                }
            }
            pb::ProviderKind::Mock | pb::ProviderKind::Unspecified => Probe::Always,
        }
    }

    /// Probes once.
    pub async fn run(&self, timeout: std::time::Duration) -> Result<(), String> {
        match self {
            Probe::Always => Ok(()),
            Probe::Http {
                provider,
                url,
                label,
            } => provider.probe_get(url, label, timeout).await,
            Probe::Program {
                program,
                search_path,
                working_dir,
            } => {
                // A few stat calls, off the event loop: a hung file system must not stall
                // the relay.
                let (program, search_path, working_dir) =
                    (program.clone(), search_path.clone(), working_dir.clone());
                let check = tokio::task::spawn_blocking(move || {
                    runnable(&program, search_path.as_deref(), working_dir.as_deref())
                });
                match tokio::time::timeout(timeout, check).await {
                    Ok(Ok(result)) => result,
                    Ok(Err(_)) => Err("the check failed".into()),
                    Err(_) => Err(format!("no answer within {}ms", timeout.as_millis())),
                }
            }
        }
    }
}

/// Whether `program` would start: a path (with a `/`, relative to `working_dir`) that is an
/// executable file, or a name found as one in `search_path`.
pub fn runnable(
    program: &str,
    search_path: Option<&str>,
    working_dir: Option<&Path>,
) -> Result<(), String> {
    if program.is_empty() {
        return Err("no program configured".into());
    }
    if program.contains('/') {
        let path = match working_dir {
            Some(dir) if Path::new(program).is_relative() => dir.join(program),
            _ => PathBuf::from(program),
        };
        return executable(&path).map_err(|why| format!("{program}: {why}"));
    }
    let found = search_path
        .unwrap_or_default()
        .split(':')
        .filter(|dir| !dir.is_empty())
        .any(|dir| executable(&Path::new(dir).join(program)).is_ok());
    if found {
        Ok(())
    } else {
        Err(format!("{program}: not found in PATH"))
    }
}

fn executable(path: &Path) -> Result<(), &'static str> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|_| "no such file")?;
    if !meta.is_file() {
        return Err("not a file");
    }
    if meta.permissions().mode() & 0o111 == 0 {
        return Err("not executable");
    }
    Ok(())
}

/// Starts probing `instance` on a task of its own, unless its kind needs no probe. The
/// task holds the instance weakly and ends when the instance is gone or `stop` is
/// cancelled.
pub fn start(instance: &Arc<AdapterInstance>, changed: watch::Sender<u64>) {
    let probe = Probe::of(instance);
    if matches!(probe, Probe::Always) {
        return;
    }
    let weak = Arc::downgrade(instance);
    let stop = instance.probe_stop.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = probe_loop(weak, probe, changed) => {}
        }
    });
}

async fn probe_loop(weak: Weak<AdapterInstance>, probe: Probe, changed: watch::Sender<u64>) {
    loop {
        let Some(timeout) = weak.upgrade().map(|i| i.health.lock().settings().timeout) else {
            return;
        };
        let result = probe.run(timeout).await;
        let Some(instance) = weak.upgrade() else {
            return;
        };
        let (change, wait) = {
            let mut tracker = instance.health.lock();
            let change = tracker
                .record(result, now_ms() as u64)
                .then(|| (tracker.health(), tracker.last_error().map(String::from)));
            (change, tracker.next_probe_in())
        };
        if let Some((health, error)) = change {
            log_change(&instance.spec.id, health, error.as_deref());
            changed.send_modify(|n| *n = n.wrapping_add(1));
        }
        drop(instance);
        tokio::time::sleep(wait).await;
    }
}

fn log_change(provider: &str, health: Health, error: Option<&str>) {
    match health {
        Health::Unhealthy => tracing::warn!(
            provider,
            last_error = error.unwrap_or(""),
            "provider is unhealthy"
        ),
        _ => tracing::info!(
            provider,
            health = health.as_str(),
            "provider health changed"
        ),
    }
}

/// A new instance's tracker: healthy at once when its kind needs no probe.
pub fn tracker_for(spec: &pb::ProviderSpec) -> ProbeTracker {
    let now = now_ms() as u64;
    match spec.kind() {
        pb::ProviderKind::Mock => ProbeTracker::always_healthy(now),
        _ => ProbeTracker::new(crate::health::HealthSettings::of(spec.health.as_ref()), now),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn instance(kind: pb::ProviderKind, base_url: &str) -> Arc<AdapterInstance> {
        let spec = pb::ProviderSpec {
            id: "p".into(),
            kind: kind as i32,
            base_url: base_url.into(),
            max_concurrency: 1,
            ..Default::default()
        };
        let clients = crate::adapters::http_clients();
        Arc::new(AdapterInstance {
            adapter: crate::adapters::build(&spec, &clients).unwrap(),
            gate: Arc::new(tokio::sync::Semaphore::new(1)),
            usage: Default::default(),
            health: parking_lot::Mutex::new(tracker_for(&spec)),
            probe_stop: Default::default(),
            spec,
        })
    }

    async fn set_faults(addr: std::net::SocketAddr, faults: serde_json::Value) {
        crate::adapters::http_clients()
            .reqwest
            .post(format!("http://{addr}/mock/faults"))
            .json(&faults)
            .send()
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn each_kind_probes_its_own_endpoint_and_errors_never_name_the_address() {
        let mock = iop_mock::MockServer::start("127.0.0.1:0".parse().unwrap(), Default::default())
            .await
            .unwrap();
        let timeout = Duration::from_secs(2);
        let probes = [
            (
                pb::ProviderKind::OpenaiCompat,
                mock.openai_base(),
                "GET /models",
            ),
            (pb::ProviderKind::Vllm, mock.openai_base(), "GET /health"),
            (
                pb::ProviderKind::Ollama,
                mock.ollama_base(),
                "GET /api/version",
            ),
        ];
        for (kind, base, _) in &probes {
            let probe = Probe::of(&instance(*kind, base));
            assert_eq!(probe.run(timeout).await, Ok(()), "{kind:?}");
        }
        set_faults(mock.addr, serde_json::json!({"health": true})).await;
        for (kind, base, label) in &probes {
            let err = Probe::of(&instance(*kind, base))
                .run(timeout)
                .await
                .unwrap_err();
            assert_eq!(
                err,
                format!("{label}: HTTP 503 Service Unavailable"),
                "{kind:?}"
            );
        }
        // Nothing listening: the cause, not the address.
        let dead = Probe::of(&instance(
            pb::ProviderKind::OpenaiCompat,
            "http://127.0.0.1:9/v1",
        ));
        let err = dead.run(timeout).await.unwrap_err();
        assert!(err.starts_with("GET /models: cannot connect"), "{err}");
        assert!(!err.contains("127.0.0.1"), "{err}");
        assert!(matches!(
            Probe::of(&instance(pb::ProviderKind::Mock, "")),
            Probe::Always
        ));
    }

    #[tokio::test]
    async fn a_probe_task_reports_a_dead_provider_and_its_recovery() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mock = iop_mock::MockServer::serve(listener, Default::default()).unwrap();
        let spec_health = pb::HealthCheckSpec {
            interval_ms: 50,
            timeout_ms: 500,
            ..Default::default()
        };
        let mut inst = instance(pb::ProviderKind::OpenaiCompat, &mock.openai_base());
        Arc::get_mut(&mut inst).unwrap().health = parking_lot::Mutex::new(ProbeTracker::new(
            crate::health::HealthSettings::of(Some(&spec_health)),
            0,
        ));
        let (changed, mut watch) = watch::channel(0u64);
        start(&inst, changed);
        let wait_for = |want: Health, watch: &mut watch::Receiver<u64>| {
            let inst = inst.clone();
            let mut watch = watch.clone();
            async move {
                tokio::time::timeout(Duration::from_secs(10), async {
                    while inst.health.lock().health() != want {
                        watch.changed().await.unwrap();
                    }
                })
                .await
                .unwrap_or_else(|_| panic!("never {want:?}"));
            }
        };
        wait_for(Health::Healthy, &mut watch).await;
        set_faults(mock.addr, serde_json::json!({"health": true})).await;
        wait_for(Health::Unhealthy, &mut watch).await;
        assert_eq!(
            inst.health.lock().last_error(),
            Some("GET /models: HTTP 503 Service Unavailable")
        );
        set_faults(mock.addr, serde_json::json!({"health": false})).await;
        wait_for(Health::Healthy, &mut watch).await;
        // The task ends with its instance.
        let stop = inst.probe_stop.clone();
        drop(inst);
        assert!(stop.is_cancelled());
        watch.mark_unchanged();
    }

    #[test]
    fn a_program_is_runnable_when_it_is_an_executable_file() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("agent.sh");
        std::fs::write(&script, "#!/bin/sh\necho hi\n").unwrap();
        let path = script.to_str().unwrap();
        assert_eq!(
            runnable(path, None, None),
            Err(format!("{path}: not executable"))
        );
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(runnable(path, None, None), Ok(()));
        // Relative to the working directory, and by name through PATH.
        assert_eq!(runnable("./agent.sh", None, Some(dir.path())), Ok(()));
        let search = dir.path().to_str().unwrap();
        assert_eq!(runnable("agent.sh", Some(search), None), Ok(()));
        assert!(runnable("agent.sh", Some("/nonexistent"), None).is_err());
        assert!(runnable("/nonexistent/agent", None, None).is_err());
        assert!(runnable(search, None, None).is_err(), "a directory");
        assert_eq!(
            runnable("sh", std::env::var("PATH").ok().as_deref(), None),
            Ok(())
        );
    }
}
