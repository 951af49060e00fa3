//! A real HAProxy in front of test edges: TCP mode (the load balancer sees bytes, not
//! requests), round robin, each edge health-checked on `/readyz` every 200 ms and taken
//! out at its first failure; a connection an edge refuses is dispatched to another.
//! Its statistics page tells a test when it has taken the edges in ([`Haproxy::wait_up`]).
//! The binary comes from `IOP_HAPROXY`, else `haproxy` on the PATH or in /usr/sbin
//! (Debian's `haproxy` package). Without it the test is skipped, unless
//! `IOP_REQUIRE_HAPROXY=1` (as in CI).

use std::path::PathBuf;
use std::time::Duration;

use super::Proc;
use super::suite::notice;

pub struct Haproxy {
    pub proc: Proc,
    /// Where clients connect.
    pub addr: String,
    /// Its statistics page, which says whether each edge is in the rotation.
    stats: String,
    _dir: tempfile::TempDir,
}

fn binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("IOP_HAPROXY") {
        return Some(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join("haproxy"))
        .find(|p| p.is_file())
}

impl Haproxy {
    /// HAProxy balancing over the edges' HTTP addresses, or `None` after a notice when
    /// there is no HAProxy here.
    pub async fn start(test: &str, backends: &[&str]) -> Option<Haproxy> {
        Self::start_with_idle_timeout(test, backends, "60s").await
    }

    /// The same, cutting a connection silent for `idle` (HAProxy's `timeout client` and
    /// `timeout server`, e.g. `2s`) as load balancers and CDNs do.
    pub async fn start_with_idle_timeout(
        test: &str,
        backends: &[&str],
        idle: &str,
    ) -> Option<Haproxy> {
        let Some(bin) = binary() else {
            assert!(
                std::env::var("IOP_REQUIRE_HAPROXY").as_deref() != Ok("1"),
                "IOP_REQUIRE_HAPROXY=1 but no haproxy (IOP_HAPROXY, PATH, /usr/sbin)"
            );
            notice(&format!(
                "SKIPPED {test}: no haproxy (IOP_HAPROXY, PATH, /usr/sbin)"
            ));
            return None;
        };
        let dir = super::tempdir();
        let addr = super::free_addr();
        let stats = super::free_addr();
        let servers: String = backends
            .iter()
            .enumerate()
            .map(|(i, backend)| format!("    server edge-{} {backend} check\n", i + 1))
            .collect();
        let config = format!(
            "global
    maxconn 4096
defaults
    mode tcp
    timeout connect 1s
    timeout client {idle}
    timeout server {idle}
    retries 3
    option redispatch
frontend stats
    mode http
    bind {stats}
    stats enable
    stats uri /stats
frontend api
    bind {addr}
    default_backend edges
backend edges
    balance roundrobin
    option httpchk
    http-check send meth GET uri /readyz ver HTTP/1.1 hdr Host localhost
    http-check expect status 200
    default-server inter 200ms fall 1 rise 2
{servers}"
        );
        let file = dir.path().join("haproxy.cfg");
        std::fs::write(&file, config).unwrap();
        let proc = Proc::spawn_program("haproxy", &bin, &["-db", "-f", file.to_str().unwrap()]);
        // Listening once a TCP connection is accepted.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(&addr).await.is_err() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "haproxy did not listen:\n{}",
                proc.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Some(Haproxy {
            proc,
            addr,
            stats,
            _dir: dir,
        })
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// The edges (`edge-1`…) HAProxy has in its rotation now, by its statistics page.
    pub async fn up(&self) -> Vec<String> {
        let Ok(response) = reqwest::get(format!("http://{}/stats;csv", self.stats)).await else {
            return Vec::new();
        };
        let csv = response.text().await.unwrap_or_default();
        let mut lines = csv.lines();
        let header: Vec<&str> = lines
            .next()
            .unwrap_or_default()
            .trim_start_matches("# ")
            .split(',')
            .collect();
        let column = |name: &str| header.iter().position(|h| *h == name);
        let (Some(proxy), Some(server), Some(status)) =
            (column("pxname"), column("svname"), column("status"))
        else {
            return Vec::new();
        };
        lines
            .map(|line| line.split(',').collect::<Vec<_>>())
            .filter(|row| {
                row.get(proxy) == Some(&"edges")
                    && row.get(server).is_some_and(|s| s.starts_with("edge-"))
                    && row.get(status) == Some(&"UP")
            })
            .map(|row| row[server].to_string())
            .collect()
    }

    /// Waits until HAProxy has every edge of `edges` (`edge-1`…) in its rotation (its
    /// health checks passed), at most 60 s.
    pub async fn wait_up(&self, edges: &[&str]) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let up = self.up().await;
            if edges.iter().all(|e| up.iter().any(|u| u == e)) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "haproxy has {up:?} in its rotation, not all of {edges:?}:\n{}",
                self.proc.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
