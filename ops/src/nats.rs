//! How every binary connects to NATS: one set of flags (with environment fallbacks) for the server URL,
//! credentials of every kind NATS offers, and TLS — and one `connect` that turns a failed handshake or
//! login into a clear error, never a panic, and never prints a secret.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;

use crate::redact::redact_url;

/// Where and how to connect to NATS.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct NatsConnection {
    /// NATS server URL: nats://host:port, or tls://host:port to require TLS (TLS is also used when
    /// the server requires it); several servers of a cluster comma-separated. user:password@ in the
    /// URL is accepted and never printed.
    #[arg(
        id = "nats_url",
        value_name = "URL",
        long = "nats-url",
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        global = true,
        hide_env_values = true
    )]
    pub url: String,

    /// NATS user name (with --nats-password).
    #[arg(
        long = "nats-user",
        env = "NATS_USER",
        global = true,
        hide_env_values = true
    )]
    pub user: Option<String>,

    /// NATS password (with --nats-user). Prefer the environment variable: flags show up in `ps`.
    #[arg(
        long = "nats-password",
        env = "NATS_PASSWORD",
        global = true,
        hide_env_values = true
    )]
    pub password: Option<String>,

    /// NATS authentication token.
    #[arg(
        long = "nats-token",
        env = "NATS_TOKEN",
        global = true,
        hide_env_values = true
    )]
    pub token: Option<String>,

    /// NATS credentials file (JWT and NKey seed, as `nsc` writes it).
    #[arg(
        long = "nats-creds",
        env = "NATS_CREDS",
        value_name = "FILE",
        global = true
    )]
    pub creds: Option<PathBuf>,

    /// File holding an NKey seed (SU…) to authenticate with.
    #[arg(
        long = "nats-nkey",
        env = "NATS_NKEY",
        value_name = "FILE",
        global = true
    )]
    pub nkey: Option<PathBuf>,

    /// PEM file of the CA that signed the NATS server's certificate (for a private CA or a
    /// self-signed server).
    #[arg(long = "nats-ca", env = "NATS_CA", value_name = "FILE", global = true)]
    pub ca: Option<PathBuf>,

    /// PEM client certificate, for servers that verify clients (with --nats-tls-key).
    #[arg(
        long = "nats-tls-cert",
        env = "NATS_TLS_CERT",
        value_name = "FILE",
        global = true
    )]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --nats-tls-cert.
    #[arg(
        long = "nats-tls-key",
        env = "NATS_TLS_KEY",
        value_name = "FILE",
        global = true
    )]
    pub tls_key: Option<PathBuf>,
}

impl From<&str> for NatsConnection {
    fn from(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            ..Self::default()
        }
    }
}

impl From<String> for NatsConnection {
    fn from(url: String) -> Self {
        Self {
            url,
            ..Self::default()
        }
    }
}

impl From<&String> for NatsConnection {
    fn from(url: &String) -> Self {
        Self::from(url.as_str())
    }
}

impl NatsConnection {
    /// The URL with any password replaced, for logs and errors.
    pub fn shown(&self) -> String {
        redact_url(&self.url)
    }

    /// Connects as `name` (shown in the server's connection list). Credentials in the URL are taken
    /// out of it and sent as user and password (the client library would otherwise ignore them).
    pub async fn connect(&self, name: &str) -> anyhow::Result<async_nats::Client> {
        // A comma-separated list names several servers of one cluster: the client connects to one
        // of them and fails over to the others (and to those the cluster advertises).
        let mut urls = Vec::new();
        let (mut url_user, mut url_password) = (None, None);
        for part in self.url.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (url, user, password) = split_credentials(part)
                .with_context(|| format!("the NATS URL {} is not valid", self.shown()))?;
            url_user = url_user.or(user);
            url_password = url_password.or(password);
            urls.push(url);
        }
        anyhow::ensure!(!urls.is_empty(), "the NATS URL is empty");
        let mut options = match (&self.creds, &self.nkey) {
            (Some(creds), _) => async_nats::ConnectOptions::with_credentials_file(creds)
                .await
                .with_context(|| {
                    format!("reading the NATS credentials file {}", creds.display())
                })?,
            (None, Some(path)) => {
                let seed = std::fs::read_to_string(path).with_context(|| {
                    format!("reading the NATS NKey seed file {}", path.display())
                })?;
                async_nats::ConnectOptions::new().nkey(seed.trim().to_owned())
            }
            (None, None) => async_nats::ConnectOptions::new(),
        };
        let user = self.user.clone().or(url_user);
        let password = self.password.clone().or(url_password);
        match (user, password) {
            (Some(user), Some(password)) => options = options.user_and_password(user, password),
            (Some(_), None) => anyhow::bail!("a NATS user needs a password (NATS_PASSWORD)"),
            (None, Some(_)) => anyhow::bail!("a NATS password needs a user (NATS_USER)"),
            (None, None) => {}
        }
        if let Some(token) = &self.token {
            options = options.token(token.clone());
        }
        if let Some(ca) = &self.ca {
            anyhow::ensure!(
                ca.is_file(),
                "the NATS CA file {} does not exist",
                ca.display()
            );
            options = options.add_root_certificates(ca.clone());
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                options = options.add_client_certificate(cert.clone(), key.clone())
            }
            (None, None) => {}
            _ => {
                anyhow::bail!("a NATS client certificate needs both NATS_TLS_CERT and NATS_TLS_KEY")
            }
        }
        if urls.iter().any(|url| url.starts_with("tls://"))
            || self.ca.is_some()
            || self.tls_cert.is_some()
        {
            options = options.require_tls(true);
        }
        options
            .name(name)
            .connection_timeout(Duration::from_secs(5))
            .connect(urls)
            .await
            .map_err(|error| anyhow::anyhow!("{}", redact_url(&error.to_string())))
            .with_context(|| format!("connecting to NATS at {}", self.shown()))
    }
}

/// Splits `user:password@` out of a NATS URL (percent-decoded), returning the URL without them.
fn split_credentials(url: &str) -> anyhow::Result<(String, Option<String>, Option<String>)> {
    let address: async_nats::ServerAddr = url.parse()?;
    let decode = |s: &str| -> anyhow::Result<String> {
        Ok(percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .context("credentials that are not UTF-8")?
            .into_owned())
    };
    let user = address.username().map(decode).transpose()?;
    let password = address.password().map(decode).transpose()?;
    if user.is_none() && password.is_none() {
        return Ok((url.to_owned(), None, None));
    }
    let mut bare = address.into_inner();
    // Neither can fail on a URL that has a host, which a parsed NATS address always has.
    let _ = bare.set_username("");
    let _ = bare.set_password(None);
    Ok((bare.to_string(), user, password))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_leave_the_url_decoded() {
        let (url, user, password) =
            split_credentials("tls://relay:p%40ss:w@127.0.0.1:4222").expect("valid");
        assert_eq!(url, "tls://127.0.0.1:4222");
        assert_eq!(user.as_deref(), Some("relay"));
        assert_eq!(password.as_deref(), Some("p@ss:w"));
        assert_eq!(
            split_credentials("nats://127.0.0.1:4222").expect("valid"),
            ("nats://127.0.0.1:4222".to_owned(), None, None)
        );
    }

    #[test]
    fn the_shown_url_hides_the_password() {
        let connection = NatsConnection::from("nats://relay:hunter2@127.0.0.1:4222");
        assert!(
            !connection.shown().contains("hunter2"),
            "{}",
            connection.shown()
        );
        assert!(connection.shown().contains("relay"));
        let cluster = NatsConnection::from(
            "nats://relay:hunter2@127.0.0.1:4222,nats://relay:hunter2@127.0.0.1:4223",
        );
        assert!(!cluster.shown().contains("hunter2"), "{}", cluster.shown());
    }
}
