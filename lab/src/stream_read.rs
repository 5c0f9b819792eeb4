//! A JetStream stream read back whole, for the checks and measurements that compare it with the
//! store (the chaos verdict, the bench's commit-to-PubAck latency).

use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;

/// How long the stream may stop delivering before its last message.
const STALL: Duration = Duration::from_secs(10);

/// Calls `each` with every message of `stream`, in order, read through an ephemeral consumer that
/// acknowledges nothing; fails when the stream stops delivering before its last sequence (as it was
/// when the read began).
pub(crate) async fn each_message(
    jetstream: &jetstream::Context,
    stream: &str,
    mut each: impl FnMut(&jetstream::Message, &jetstream::message::Info<'_>),
) -> anyhow::Result<()> {
    let mut stream = jetstream.get_stream(stream).await?;
    let last = stream.info().await?.state.last_sequence;
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            deliver_policy: jetstream::consumer::DeliverPolicy::All,
            ack_policy: jetstream::consumer::AckPolicy::None,
            inactive_threshold: Duration::from_secs(60),
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let mut sequence = 0;
    while sequence < last {
        let next = tokio::time::timeout(STALL, messages.next())
            .await
            .map_err(|_| {
                anyhow::anyhow!("the stream stopped delivering at sequence {sequence} of {last}")
            })?;
        let Some(message) = next else { break };
        let message = message.map_err(|e| anyhow::anyhow!("reading the stream: {e}"))?;
        let info = message
            .info()
            .map_err(|e| anyhow::anyhow!("a message without delivery info: {e}"))?;
        sequence = info.stream_sequence;
        each(&message, &info);
    }
    Ok(())
}
