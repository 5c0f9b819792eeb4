//! Relaying a test's outbox: every row published with the relay's own library, as a running relay
//! would, for tests whose subject is what comes after the stream (projections, the console).

/// Publishes every outbox row into `stream` (created if missing) and returns the relay once nothing is
/// left to send (its sessions stay open, named as a relay's, while it is kept).
pub async fn relay_everything(url: &str, nats: &str, stream: &str, prefix: &str) -> relay::Relay {
    let settings = relay::StreamSettings {
        name: stream.into(),
        subject_prefix: prefix.into(),
        ..relay::StreamSettings::default()
    };
    let config = relay::RelayConfig {
        stream: settings,
        ..relay::RelayConfig::default()
    };
    let relay = relay::Relay::connect(url, nats, config)
        .await
        .expect("relay connects");
    relay.provision(false).await.expect("stream");
    relay.drain().await.expect("relay drains");
    relay
}
