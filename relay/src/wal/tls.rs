//! TLS on the replication session. The replication crate's own TLS stack brings a crypto provider
//! this project bans, so the relay opens the TLS session itself — with the rustls and ring that sqlx
//! and async-nats already use, the certificate checked as `sslmode` says, and the client certificate
//! of `sslcert`/`sslkey` presented when the URL has one — and lends the crate a
//! Unix socket, in a directory only the relay's user may enter, whose bytes it carries over that
//! session.

use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixListener};
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// How the server's certificate is checked, read as sqlx reads `sslmode`: `require` encrypts and
/// checks nothing, `verify-ca` checks the chain, `verify-full` the chain and the host's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verify {
    Nothing,
    Authority,
    AuthorityAndName,
}

/// Certificates or a key as the URL gives them: a file, or the PEM text itself (as sqlx accepts
/// from `PGSSLROOTCERT`, `PGSSLCERT` and `PGSSLKEY`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pem {
    File(PathBuf),
    Text(String),
}

/// The client certificate the session presents (`sslcert`, its chain) and its key (`sslkey`), for a
/// server whose `pg_hba.conf` asks for one (`cert`, or `clientcert=verify-full`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub certificate: Pem,
    pub key: Pem,
}

/// Where the replication session's TLS goes and how the server is checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsTarget {
    pub host: String,
    pub port: u16,
    pub verify: Verify,
    /// The certificate authorities `sslrootcert` names. Without it, the public authorities, as sqlx
    /// trusts them.
    pub roots: Option<Pem>,
    pub identity: Option<Identity>,
}

/// PostgreSQL's SSLRequest: the length 8, then the code 80877103.
const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

/// The server's connection and handshake, and the replication client's connection to the bridge,
/// each get this long.
const WITHIN: Duration = Duration::from_secs(30);

/// Once the replication client has closed its side, how long the server gets to close its own.
const CLOSING: Duration = Duration::from_secs(5);

impl TlsTarget {
    /// Opens the TLS session to the server — a refused certificate fails here, with rustls' reason —
    /// and returns the directory of the Unix socket (named as PostgreSQL names its own,
    /// `.s.PGSQL.<port>`) where the replication client connects in plain text. The directory is
    /// made for this session, mode 0700: no other user's process can reach the bridge, or take
    /// its place. One connection is accepted, then the socket and its directory are removed; the
    /// bytes flow until either side ends.
    pub async fn open_bridge(&self) -> anyhow::Result<PathBuf> {
        let tls = tokio::time::timeout(WITHIN, self.connect())
            .await
            .map_err(|_| {
                anyhow::anyhow!("{}: no TLS session within {WITHIN:?}", self.address())
            })??;
        let directory = private_directory()?;
        let socket = directory.join(format!(".s.PGSQL.{}", self.port));
        let listener = match UnixListener::bind(&socket) {
            Ok(listener) => listener,
            Err(error) => {
                let _ = std::fs::remove_dir_all(&directory);
                return Err(error).context("the replication session's TLS bridge");
            }
        };
        let server = self.address();
        let bridge = directory.clone();
        tokio::spawn(async move {
            let accepted = tokio::time::timeout(WITHIN, listener.accept()).await;
            drop(listener);
            let _ = std::fs::remove_dir_all(&bridge);
            match accepted {
                Ok(Ok((plain, _))) => carry(plain, tls, &server).await,
                Ok(Err(error)) => {
                    tracing::warn!(%server, %error, "the replication client could not reach its TLS bridge")
                }
                Err(_) => {
                    tracing::warn!(%server, "the replication client never reached its TLS bridge")
                }
            }
        });
        Ok(directory)
    }

    fn address(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// The server's answer to an SSLRequest, then the handshake on the same connection.
    async fn connect(&self) -> anyhow::Result<TlsStream<TcpStream>> {
        let server = self.address();
        let mut tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .with_context(|| format!("connecting to {server} for the replication session"))?;
        tcp.set_nodelay(true)?;
        tcp.write_all(&SSL_REQUEST).await?;
        let mut answer = [0u8; 1];
        tcp.read_exact(&mut answer)
            .await
            .with_context(|| format!("{server} closed the connection when asked for TLS"))?;
        anyhow::ensure!(
            answer[0] == b'S',
            "{server} does not offer TLS (it answered {:?}), which the URL's sslmode requires",
            char::from(answer[0])
        );
        // Nothing read past the answer: bytes a man in the middle slipped in before the handshake
        // reach rustls as records and fail it.
        let name = ServerName::try_from(self.host.clone())
            .with_context(|| format!("{:?} is not a host name TLS can check", self.host))?;
        TlsConnector::from(Arc::new(self.client_config()?))
            .connect(name, tcp)
            .await
            .with_context(|| format!("TLS with {server} for the replication session"))
    }

    fn client_config(&self) -> anyhow::Result<ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier: Arc<dyn ServerCertVerifier> = match self.verify {
            Verify::Nothing => Arc::new(Unchecked(provider.clone())),
            verify => {
                let webpki = WebPkiServerVerifier::builder_with_provider(
                    Arc::new(self.root_store()?),
                    provider.clone(),
                )
                .build()?;
                if verify == Verify::Authority {
                    Arc::new(AnyName(webpki))
                } else {
                    webpki
                }
            }
        };
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let mut config = match &self.identity {
            None => builder.with_no_client_auth(),
            Some(identity) => {
                let (chain, key) = identity.load()?;
                // rustls checks here that the key is the certificate's.
                builder
                    .with_client_auth_cert(chain, key)
                    .context("sslcert and sslkey")?
            }
        };
        // What libpq offers since PostgreSQL 17; older servers ignore it.
        config.alpn_protocols = vec![b"postgresql".to_vec()];
        Ok(config)
    }

    fn root_store(&self) -> anyhow::Result<RootCertStore> {
        let mut store = RootCertStore::empty();
        let Some(roots) = &self.roots else {
            store.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
            return Ok(store);
        };
        for certificate in roots.certificates("sslrootcert")? {
            store.add(certificate).context("sslrootcert")?;
        }
        Ok(store)
    }
}

impl Pem {
    /// Every certificate it holds, in order (a chain starts with its own), or an error naming
    /// `setting`.
    fn certificates(&self, setting: &str) -> anyhow::Result<Vec<CertificateDer<'static>>> {
        let certificates: Vec<_> = match self {
            Self::File(path) => CertificateDer::pem_file_iter(path)
                .and_then(|certificates| certificates.collect())
                .with_context(|| format!("{setting} {}", path.display()))?,
            Self::Text(text) => CertificateDer::pem_slice_iter(text.as_bytes())
                .collect::<Result<_, _>>()
                .with_context(|| setting.to_owned())?,
        };
        anyhow::ensure!(!certificates.is_empty(), "{setting} holds no certificate");
        Ok(certificates)
    }

    /// The first private key it holds (PKCS #8, PKCS #1 or SEC1), or an error naming `setting`.
    fn private_key(&self, setting: &str) -> anyhow::Result<PrivateKeyDer<'static>> {
        match self {
            Self::File(path) => PrivateKeyDer::from_pem_file(path)
                .with_context(|| format!("{setting} {}", path.display())),
            Self::Text(text) => {
                PrivateKeyDer::from_pem_slice(text.as_bytes()).with_context(|| setting.to_owned())
            }
        }
    }
}

impl Identity {
    fn load(&self) -> anyhow::Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
        Ok((
            self.certificate.certificates("sslcert")?,
            self.key.private_key("sslkey")?,
        ))
    }
}

/// A new directory only this user may enter, under the system's temporary directory.
fn private_directory() -> anyhow::Result<PathBuf> {
    let name = format!(
        "waybill-relay-tls-{}-{}",
        std::process::id(),
        uuid::Uuid::now_v7().simple()
    );
    let directory = std::env::temp_dir().join(name);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&directory)
        .with_context(|| format!("making {}", directory.display()))?;
    Ok(directory)
}

/// Carries bytes both ways until the server closes, or the client has closed and the server has
/// had [`CLOSING`] to follow: a server gone silent does not keep the task and its sockets.
async fn carry(plain: impl AsyncRead + AsyncWrite, tls: impl AsyncRead + AsyncWrite, server: &str) {
    let (mut plain_read, mut plain_write) = tokio::io::split(plain);
    let (mut tls_read, mut tls_write) = tokio::io::split(tls);
    let up = async {
        let copied = tokio::io::copy(&mut plain_read, &mut tls_write).await;
        let _ = tls_write.shutdown().await;
        copied
    };
    let down = async {
        let copied = tokio::io::copy(&mut tls_read, &mut plain_write).await;
        let _ = plain_write.shutdown().await;
        copied
    };
    tokio::pin!(up, down);
    let ended = tokio::select! {
        copied = &mut down => copied,
        copied = &mut up => match tokio::time::timeout(CLOSING, &mut down).await {
            Ok(down) => copied.and(down),
            Err(_) => copied,
        },
    };
    if let Err(error) = ended {
        tracing::debug!(%server, %error, "the replication session's TLS ended");
    }
}

/// `sslmode=require`: encrypted, the certificate taken as it comes (the handshake's signatures are
/// still checked, so the session is with the holder of that certificate's key).
#[derive(Debug)]
struct Unchecked(Arc<CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `sslmode=verify-ca`: the chain checked against the roots, the host's name not. rustls checks the
/// name after the chain, so a name error means the chain passed.
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            verdict => verdict,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}
