//! NATS as operators run it, for tests: a private CA with server and client
//! certificates (made with the `openssl` command), and nats-servers started from a
//! configuration file of the test's own (TLS, logins, cluster routes).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};

use crate::wait_for;

/// A private CA, a server certificate for 127.0.0.1 and localhost, and a client
/// certificate, as PEM files in a directory of their own.
pub struct TestPki {
    /// The CA's certificate.
    pub ca: PathBuf,
    /// The servers' certificate and key.
    pub server_cert: PathBuf,
    /// The servers' key.
    pub server_key: PathBuf,
    /// A client certificate signed by the CA.
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
    _dir: tempfile::TempDir,
}

fn openssl(dir: &Path, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .context("while running openssl (Debian's openssl package)")?;
    if !out.status.success() {
        bail!("openssl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

impl TestPki {
    /// Make the CA and both certificates.
    pub fn new() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let d = dir.path();
        let key = |name: &str| openssl(d, &["ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", name]);
        key("ca.key")?;
        openssl(
            d,
            &[
                "req",
                "-x509",
                "-new",
                "-key",
                "ca.key",
                "-days",
                "2",
                "-subj",
                "/CN=looseleaf test CA",
                "-out",
                "ca.pem",
            ],
        )?;
        let sign = |name: &str, subject: &str, ext: &str| -> anyhow::Result<()> {
            key(&format!("{name}.key"))?;
            openssl(
                d,
                &["req", "-new", "-key", &format!("{name}.key"), "-subj", subject, "-out", &format!("{name}.csr")],
            )?;
            std::fs::write(d.join(format!("{name}.ext")), ext)?;
            openssl(
                d,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &format!("{name}.csr"),
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-days",
                    "2",
                    "-extfile",
                    &format!("{name}.ext"),
                    "-out",
                    &format!("{name}.pem"),
                ],
            )
        };
        sign(
            "server",
            "/CN=nats",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
        )?;
        sign("client", "/CN=looseleaf-service", "extendedKeyUsage=clientAuth\n")?;
        Ok(Self {
            ca: d.join("ca.pem"),
            server_cert: d.join("server.pem"),
            server_key: d.join("server.key"),
            client_cert: d.join("client.pem"),
            client_key: d.join("client.key"),
            _dir: dir,
        })
    }

    /// A nats-server `tls` block that requires TLS and verifies client certificates.
    pub fn server_tls_block(&self) -> String {
        format!(
            "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: true\n  timeout: 5\n}}\n",
            self.server_cert.display(),
            self.server_key.display(),
            self.ca.display()
        )
    }
}

/// A nats-server started from a configuration the test wrote; killed on drop.
pub struct ConfiguredNats {
    child: Option<Child>,
    config: PathBuf,
    /// Its client port on 127.0.0.1.
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl ConfiguredNats {
    /// Start nats-server with `config` (which must listen on 127.0.0.1:`port`) and
    /// wait until it accepts connections.
    pub fn start(port: u16, config: &str) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("nats.conf");
        std::fs::write(&path, config)?;
        let mut server = Self { child: None, config: path, port, _dir: dir };
        server.spawn()?;
        Ok(server)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let bin = schemas::locate::nats_server(None);
        let child = Command::new(&bin)
            .arg("-c")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("while starting {}", bin.display()))?;
        self.child = Some(child);
        let port = self.port;
        wait_for(Duration::from_secs(15), || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok())
            .with_context(|| format!("nats-server with {} did not listen on {port}", self.config.display()))
    }

    /// Kill it (SIGKILL: a node lost, not one that leaves cleanly).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start it again with the same configuration (and JetStream store).
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.spawn()
    }
}

impl Drop for ConfiguredNats {
    fn drop(&mut self) {
        self.kill();
    }
}
