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
        for part in servers(&self.url) {
            let (url, user, password) = split_credentials(&part)
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
            // A permission the server refuses comes back as a client event, not as the request's
            // answer (which then only times out): remember it, so that the error says what happened.
            .event_callback(|event| async move { crate::nats_refusal::observe(&event) })
            .connection_timeout(Duration::from_secs(5))
            .connect(urls)
            .await
            .map_err(|error| anyhow::anyhow!("{}", redact_url(&error.to_string())))
            .with_context(|| format!("connecting to NATS at {}", self.shown()))
    }
}

/// The servers of a comma-separated NATS URL list. A comma inside a password (`nats://u:p,ss@h`)
/// does not split: a piece that is no address on its own and whose user info the next piece ends
/// (that piece has an `@` and no scheme) is joined with it.
fn servers(list: &str) -> Vec<String> {
    let mut servers: Vec<String> = Vec::new();
    for piece in list.split(',') {
        if let Some(last) = servers.last_mut() {
            let open = {
                let authority = last.split_once("://").map_or(last.as_str(), |(_, r)| r);
                authority.contains(':') && !authority.contains('@')
            };
            if open
                && piece.contains('@')
                && !piece.contains("://")
                && split_credentials(last.trim()).is_err()
            {
                last.push(',');
                last.push_str(piece);
                continue;
            }
        }
        servers.push(piece.to_owned());
    }
    servers
        .into_iter()
        .map(|server| server.trim().to_owned())
        .filter(|server| !server.is_empty())
        .collect()
}

/// Splits `user:password@` out of a NATS URL (percent-decoded), returning the URL without them. The
/// user info ends at the URL's last `@`, so a password may hold `#`, `/` or `?` unencoded (the URL
/// parser would take them for the end of the host).
fn split_credentials(url: &str) -> anyhow::Result<(String, Option<String>, Option<String>)> {
    let decode = |s: &str| -> anyhow::Result<Option<String>> {
        let decoded = percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .context("credentials that are not UTF-8")?;
        Ok((!decoded.is_empty()).then(|| decoded.into_owned()))
    };
    let (scheme, rest) = url.split_once("://").unwrap_or(("nats", url));
    let Some((user_info, host)) = rest.rsplit_once('@') else {
        let _: async_nats::ServerAddr = url.parse()?;
        return Ok((url.to_owned(), None, None));
    };
    let (user, password) = user_info
        .split_once(':')
        .map_or((user_info, None), |(user, password)| (user, Some(password)));
    let bare = format!("{scheme}://{host}");
    let _: async_nats::ServerAddr = bare.parse()?;
    let password = match password {
        Some(password) => decode(password)?,
        None => None,
    };
    Ok((bare, decode(user)?, password))
}

/// The partitions a stream's configuration splits at the broker (its subject transform is
/// `domain::wire::partition_transform`'s for `subject_prefix`): 1 when it splits none.
pub fn stream_partitions(
    config: &async_nats::jetstream::stream::Config,
    subject_prefix: &str,
) -> u32 {
    config
        .subject_transform
        .as_ref()
        .and_then(|t| {
            domain::wire::partitions_of_transform(subject_prefix, &t.source, &t.destination)
        })
        .unwrap_or(1)
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
        for password in ["p#ss", "p/ss", "p?ss", "p@ss", "p:ss", "p,ss", "12/ss"] {
            let (url, user, decoded) =
                split_credentials(&format!("nats://relay:{password}@127.0.0.1:4222"))
                    .expect("valid");
            assert_eq!(url, "nats://127.0.0.1:4222");
            assert_eq!(user.as_deref(), Some("relay"));
            assert_eq!(decoded.as_deref(), Some(password));
        }
    }

    #[test]
    fn a_comma_splits_servers_but_not_a_password() {
        assert_eq!(
            servers("nats://a:4222, nats://b:4222"),
            ["nats://a:4222", "nats://b:4222"]
        );
        assert_eq!(servers("nats://u:p,ss@h:4222"), ["nats://u:p,ss@h:4222"]);
        assert_eq!(
            servers("nats://u:p,ss@h:4222,nats://h2:4222"),
            ["nats://u:p,ss@h:4222", "nats://h2:4222"]
        );
        assert_eq!(servers("a:4222,b:4222"), ["a:4222", "b:4222"]);
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
