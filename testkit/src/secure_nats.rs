//! A private nats-server with TLS (a throwaway CA made with the `openssl` command) and the project's
//! shipped accounts (deploy/nats/accounts.conf), renamed to a test's stream and subject prefix.

use std::path::{Path, PathBuf};
use std::process::Command;

use tempfile::TempDir;

use crate::NatsServer;

/// The relay user's password in [`SecureNats`].
pub const RELAY_PASSWORD: &str = "relay-Secret-1";
/// The inventory user's password in [`SecureNats`].
pub const INVENTORY_PASSWORD: &str = "inventory-Secret-2";
/// The points user's password in [`SecureNats`].
pub const POINTS_PASSWORD: &str = "points-pw";

/// The running server, its CA and its folder (removed on drop).
#[derive(Debug)]
pub struct SecureNats {
    /// The server (TLS required; its `url()` says nats:// — use tls://).
    pub server: NatsServer,
    /// The CA file that signed the server's certificate.
    pub ca: PathBuf,
    // Declared after the server, so the server is stopped before its certificates are removed.
    _dir: TempDir,
}

impl SecureNats {
    /// Starts it for `stream` under `prefix`.
    pub fn start(stream: &str, prefix: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("waybill-tls-")
            .tempdir()
            .expect("temp dir");
        let (ca, cert, key) = certificates(dir.path(), LOOPBACK_NAMES);
        let shipped = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/nats/accounts.conf"
        ))
        .expect("the shipped accounts.conf");
        let accounts = shipped
            .replace("WAYBILL_EVENTS", stream)
            .replace("waybill.events", prefix)
            .replace("$WAYBILL_RELAY_PASSWORD", &format!("\"{RELAY_PASSWORD}\""))
            .replace(
                "$WAYBILL_INVENTORY_PASSWORD",
                &format!("\"{INVENTORY_PASSWORD}\""),
            )
            .replace(
                "$WAYBILL_POINTS_PASSWORD",
                &format!("\"{POINTS_PASSWORD}\""),
            )
            .replace("$WAYBILL_SEARCH_PASSWORD", "\"search-pw\"")
            .replace("$WAYBILL_ADMIN_PASSWORD", "\"admin-pw\"");
        // Every other user (a read model's, added to the registry): `<name>-pw`.
        let accounts = other_passwords(&accounts);
        let config = format!(
            "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n}}\n{accounts}",
            cert.display(),
            key.display()
        );
        let server = NatsServer::start_with_config(&config).expect("secure nats-server");
        Self {
            server,
            ca,
            _dir: dir,
        }
    }

    /// `tls://user:password@127.0.0.1:PORT`.
    pub fn url_for(&self, user: &str, password: &str) -> String {
        self.server
            .url()
            .replace("nats://", &format!("tls://{user}:{password}@"))
    }
}

/// The names a test server's certificate carries unless a test asks for others.
pub(crate) const LOOPBACK_NAMES: &str = "IP:127.0.0.1,DNS:localhost";

/// Runs the openssl command with `args` in `dir`, and panics if it fails.
fn openssl(dir: &Path, args: &[&str]) {
    let status = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stderr(std::process::Stdio::null())
        .status()
        .expect("openssl runs");
    assert!(status.success(), "openssl {args:?}");
}

/// A client certificate whose name (CN) is `user`, signed by the CA [`certificates`] made in `dir`:
/// the certificate's and its key's paths.
pub(crate) fn client_certificate(dir: &Path, user: &str) -> (PathBuf, PathBuf) {
    signed(
        dir,
        "client",
        &format!("/CN={user}"),
        "extendedKeyUsage=clientAuth",
    )
}

/// A self-signed CA and a server certificate for `names` (a `subjectAltName` list, such as
/// [`LOOPBACK_NAMES`]), made with the openssl command in `dir`: the CA's, the server's and the
/// server key's paths.
pub(crate) fn certificates(dir: &Path, names: &str) -> (PathBuf, PathBuf, PathBuf) {
    let ca = self_signed_ca(dir, "waybill test CA");
    let (server, key) = signed(
        dir,
        "server",
        "/CN=127.0.0.1",
        &format!("subjectAltName={names}"),
    );
    (ca, server, key)
}

/// A certificate authority of its own named `common_name`, made with the openssl command in `dir`
/// (`ca.pem`, its key `ca-key.pem`): its certificate's path. A stranger to every other one.
pub fn self_signed_ca(dir: &Path, common_name: &str) -> PathBuf {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            &format!("/CN={common_name}"),
            "-keyout",
            "ca-key.pem",
            "-out",
            "ca.pem",
        ],
    );
    dir.join("ca.pem")
}

/// A key and a certificate for `subject` with the extension `extension` (which also makes it an
/// X.509 v3 certificate, the only version webpki accepts), signed by the CA in `dir`, written as
/// `<name>.pem` and `<name>-key.pem`: their paths.
fn signed(dir: &Path, name: &str, subject: &str, extension: &str) -> (PathBuf, PathBuf) {
    let (request, certificate, key, extensions) = (
        format!("{name}.csr"),
        format!("{name}.pem"),
        format!("{name}-key.pem"),
        format!("{name}.ext"),
    );
    let run = |args: &[&str]| openssl(dir, args);
    run(&[
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", &key, "-out", &request,
    ]);
    std::fs::write(dir.join(&extensions), format!("{extension}\n")).expect("ext");
    run(&[
        "x509",
        "-req",
        "-in",
        &request,
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca-key.pem",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        &extensions,
        "-out",
        &certificate,
    ]);
    (dir.join(certificate), dir.join(key))
}

/// `text` with every remaining `$WAYBILL_<NAME>_PASSWORD` replaced by `"<name>-pw"`: nats-server
/// refuses a configuration that names an unset variable.
fn other_passwords(text: &str) -> String {
    const START: &str = "$WAYBILL_";
    const END: &str = "_PASSWORD";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(START) {
        out.push_str(&rest[..at]);
        let after = &rest[at + START.len()..];
        let name_len = after
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(after.len());
        match after[..name_len].strip_suffix(END) {
            Some(name) => {
                out.push_str(&format!("\"{}-pw\"", name.to_ascii_lowercase()));
                rest = &after[name_len..];
            }
            None => {
                out.push_str(START);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}
