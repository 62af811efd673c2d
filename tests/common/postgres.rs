//! A throw-away PostgreSQL server (Debian's postgresql) on a free port, run as the `postgres`
//! user when the test runs as root (PostgreSQL refuses root), optionally with TLS on: a CA
//! and a server certificate for 127.0.0.1 made for the test with the `openssl` command.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A running server; killed on drop.
pub struct PgServer {
    child: std::process::Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// With TLS: the CA certificate (PEM) that signed the server's certificate.
    pub ca_file: Option<PathBuf>,
    dir: tempfile::TempDir,
}

/// Whether the tests run as root.
pub fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn openssl(dir: &Path, args: &[&str]) {
    let st = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("the openssl command runs");
    assert!(st.success(), "openssl {args:?} failed");
}

/// Writes `ca.pem`, `server.pem` (for 127.0.0.1 and localhost), `server.key`, and a client
/// certificate `client.pem` with `client.key`, into `dir`.
pub fn make_test_ca(dir: &Path) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=runner test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ],
    );
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            "server.pem",
        ],
    );
    // A client certificate from the same CA, for mutual TLS.
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=runner-client",
        ]
        .into_iter()
        .chain(["-keyout", "client.key", "-out", "client.csr"])
        .collect::<Vec<_>>(),
    );
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "client.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
        ]
        .into_iter()
        .chain(["-CAcreateserial", "-days", "2", "-extfile", "client.ext"])
        .chain(["-out", "client.pem"])
        .collect::<Vec<_>>(),
    );
}

impl PgServer {
    /// A plain-text server.
    pub fn start() -> Self {
        Self::start_with(false)
    }

    /// A server with `ssl = on`, its certificate signed by a CA made for this test.
    pub fn start_tls() -> Self {
        Self::start_with(true)
    }

    fn start_with(tls: bool) -> Self {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .ok()
            .and_then(|d| d.filter_map(Result::ok).map(|e| e.path().join("bin")).max())
            .filter(|p| p.join("initdb").exists())
            .expect("PostgreSQL not found: install Debian's postgresql (scripts/setup-deps does)");
        let dir = tempfile::tempdir().unwrap();
        let root = running_as_root();
        let run = |prog: &Path, args: &[&str]| {
            let mut c = if root {
                let mut c = Command::new("runuser");
                c.args(["-u", "postgres", "--"]).arg(prog);
                c
            } else {
                Command::new(prog)
            };
            c.args(args);
            c
        };
        let certs = dir.path().join("certs");
        let mut extra: Vec<String> = Vec::new();
        if tls {
            std::fs::create_dir(&certs).unwrap();
            make_test_ca(&certs);
            extra = vec![
                "-c".into(),
                "ssl=on".into(),
                "-c".into(),
                format!("ssl_cert_file={}", certs.join("server.pem").display()),
                "-c".into(),
                format!("ssl_key_file={}", certs.join("server.key").display()),
            ];
        }
        if root {
            Command::new("chown")
                .args(["-R", "postgres"])
                .arg(dir.path())
                .status()
                .unwrap();
        }
        if tls {
            // PostgreSQL refuses a key others can read.
            Command::new("chmod")
                .arg("600")
                .arg(certs.join("server.key"))
                .status()
                .unwrap();
        }
        let data = dir.path().join("data");
        let st = run(
            &bin.join("initdb"),
            &[
                "-D",
                data.to_str().unwrap(),
                "-A",
                "trust",
                "-U",
                "postgres",
            ],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
        assert!(st.success(), "initdb failed");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let port_s = port.to_string();
        let mut args = vec![
            "-D",
            data.to_str().unwrap(),
            "-p",
            &port_s,
            "-k",
            dir.path().to_str().unwrap(),
            "-c",
            "listen_addresses=127.0.0.1",
        ];
        args.extend(extra.iter().map(String::as_str));
        let child = run(&bin.join("postgres"), &args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "postgres did not listen");
            std::thread::sleep(Duration::from_millis(100));
        }
        Self {
            child,
            port,
            ca_file: tls.then(|| certs.join("ca.pem")),
            dir,
        }
    }

    /// A connection string for user `postgres` (trust authentication), plain text.
    pub fn url(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        )
    }

    /// A plain-text client as the `postgres` user, retried while the server starts up
    /// after it opened its port.
    pub async fn client(&self) -> tokio_postgres::Client {
        loop {
            match tokio_postgres::connect(&self.url(), tokio_postgres::NoTls).await {
                Ok((client, conn)) => {
                    tokio::spawn(conn);
                    return client;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// A directory for the test's own files, removed with the server.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
