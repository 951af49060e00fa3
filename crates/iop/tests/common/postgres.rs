//! A real PostgreSQL server for the store tests, started in a temporary directory (fsync
//! off) on a free loopback port and stopped when dropped. Its binaries come from
//! `IOP_PG_BIN`, else the newest `/usr/lib/postgresql/<version>/bin` (Debian's
//! `postgresql` package). As root it runs as the `postgres` user (the server refuses
//! root). Without binaries the test is skipped, unless `IOP_REQUIRE_POSTGRES=1` (as in CI).
//! [`Postgres::start_tls`] serves TLS only (a certificate from a CA of the test's own;
//! connections without TLS are refused).

use std::path::{Path, PathBuf};
use std::process::Command;

use super::suite::notice;

/// The store secret key the fleet tests give every edge (base64 of 32 bytes).
pub const SECRET_KEY: &str = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=";

pub struct Postgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    pub port: u16,
    /// With TLS: the PEM certificate of the CA that signed the server's.
    pub ca_file: Option<PathBuf>,
    /// The server's options, to start it again after [`Postgres::stop`].
    options: String,
}

/// Where the server's binaries are.
fn bin_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("IOP_PG_BIN") {
        return Some(PathBuf::from(dir));
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| Some(e.ok()?.path().join("bin")))
        .filter(|bin| bin.join("pg_ctl").is_file())
        .collect();
    versions.sort();
    versions.pop()
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Runs one of the server's programs (as `postgres` when we are root); panics on failure.
fn run(bin: &Path, program: &str, args: &[&str]) {
    let path = bin.join(program);
    let mut command = if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(&path);
        c
    } else {
        Command::new(&path)
    };
    let out = command
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Postgres {
    /// A fresh server with a database `iop` owned by the trusted user `iop`, or `None`
    /// after a notice when there is no PostgreSQL here.
    pub fn start(test: &str) -> Option<Postgres> {
        Self::start_with(test, false)
    }

    /// A server that takes TLS connections only, its certificate (for `localhost` and
    /// 127.0.0.1) signed by a CA whose certificate is [`Postgres::ca_file`].
    pub fn start_tls(test: &str) -> Option<Postgres> {
        Self::start_with(test, true)
    }

    fn start_with(test: &str, tls: bool) -> Option<Postgres> {
        let Some(bin) = bin_dir() else {
            assert!(
                std::env::var("IOP_REQUIRE_POSTGRES").as_deref() != Ok("1"),
                "IOP_REQUIRE_POSTGRES=1 but no PostgreSQL binaries (IOP_PG_BIN, /usr/lib/postgresql/*/bin)"
            );
            notice(&format!(
                "SKIPPED {test}: no PostgreSQL binaries (IOP_PG_BIN, /usr/lib/postgresql/*/bin)"
            ));
            return None;
        };
        let dir = super::tempdir();
        if is_root() {
            let status = Command::new("chown")
                .args(["postgres:postgres", dir.path().to_str().unwrap()])
                .status()
                .unwrap();
            assert!(status.success(), "chown the server's directory to postgres");
        }
        let data = dir.path().join("data");
        let (data_s, dir_s) = (data.to_str().unwrap(), dir.path().to_str().unwrap());
        run(
            &bin,
            "initdb",
            &[
                "-D",
                data_s,
                "-A",
                "trust",
                "-U",
                "iop",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut options = format!(
            "-p {port} -k {dir_s} -c listen_addresses=127.0.0.1 -c fsync=off \
             -c synchronous_commit=off -c full_page_writes=off"
        );
        let ca_file = tls.then(|| {
            let ca_file = dir.path().join("ca.pem");
            let (cert, key) = (data.join("server.crt"), data.join("server.key"));
            make_server_certificate(&ca_file, &cert, &key);
            options.push_str(&format!(
                " -c ssl=on -c ssl_cert_file={} -c ssl_key_file={}",
                cert.display(),
                key.display()
            ));
            // TLS only: a connection without it is refused.
            std::fs::write(
                data.join("pg_hba.conf"),
                "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
            )
            .unwrap();
            if is_root() {
                for file in [&cert, &key, &data.join("pg_hba.conf")] {
                    let status = Command::new("chown")
                        .args(["postgres:postgres", file.to_str().unwrap()])
                        .status()
                        .unwrap();
                    assert!(status.success());
                }
            }
            ca_file
        });
        let log = dir.path().join("server.log");
        run(
            &bin,
            "pg_ctl",
            &[
                "-D",
                data_s,
                "-l",
                log.to_str().unwrap(),
                "-o",
                &options,
                "-w",
                "-t",
                "120",
                "start",
            ],
        );
        let port_s = port.to_string();
        run(
            &bin,
            "createdb",
            &["-h", "127.0.0.1", "-p", &port_s, "-U", "iop", "iop"],
        );
        Some(Postgres {
            dir,
            bin,
            port,
            ca_file,
            options,
        })
    }

    /// The store URL of its `iop` database.
    pub fn url(&self) -> String {
        format!("postgres://iop@127.0.0.1:{}/iop", self.port)
    }

    /// Starts the server again after [`Postgres::stop`], on the same port and data.
    pub fn restart(&self) {
        let data = self.dir.path().join("data");
        let log = self.dir.path().join("server.log");
        run(
            &self.bin,
            "pg_ctl",
            &[
                "-D",
                data.to_str().unwrap(),
                "-l",
                log.to_str().unwrap(),
                "-o",
                &self.options,
                "-w",
                "-t",
                "120",
                "start",
            ],
        );
    }

    /// The first column of the first row `sql` returns, as `psql` prints it.
    pub fn query(&self, sql: &str) -> String {
        let out = Command::new(self.bin.join("psql"))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "iop",
                "-d",
                "iop",
            ])
            .args(["-tAc", sql])
            .output()
            .expect("run psql");
        assert!(
            out.status.success(),
            "psql {sql:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Stops the server at once (as a crash would).
    pub fn stop(&self) {
        let data = self.dir.path().join("data");
        run(
            &self.bin,
            "pg_ctl",
            &["-D", data.to_str().unwrap(), "-m", "immediate", "stop"],
        );
    }
}

/// A CA (its certificate to `ca_file`) and a server certificate it signed for `localhost`
/// and 127.0.0.1 (to `cert`, its key to `key`, 0600 as the server requires).
fn make_server_certificate(ca_file: &Path, cert: &Path, key: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "test store CA");
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::from_params(&ca_params, &ca_key);
    let server_key = rcgen::KeyPair::generate().unwrap();
    let params =
        rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .unwrap();
    let server = params.signed_by(&server_key, &issuer).unwrap();
    std::fs::write(ca_file, ca_cert.pem()).unwrap();
    std::fs::write(cert, server.pem()).unwrap();
    std::fs::write(key, server_key.serialize_pem()).unwrap();
    std::fs::set_permissions(key, std::fs::Permissions::from_mode(0o600)).unwrap();
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let data = self.dir.path().join("data");
        if data.join("postmaster.pid").exists() {
            let program = self.bin.join("pg_ctl");
            let mut command = if is_root() {
                let mut c = Command::new("runuser");
                c.args(["-u", "postgres", "--"]).arg(&program);
                c
            } else {
                Command::new(&program)
            };
            let _ = command
                .args(["-D", data.to_str().unwrap(), "-m", "immediate", "stop"])
                .output();
        }
    }
}
