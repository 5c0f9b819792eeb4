//! What the console reads from NATS: the stream's state, the projections' durable consumers, and one
//! order's messages on its subject. NATS is optional for the console: the connection is made in
//! the background and retried, and until it exists (or while it is down) every reading says why it
//! is unavailable instead of failing the page.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::DeliverPolicy, consumer::pull};
use futures::StreamExt;
use serde::Serialize;
use uuid::Uuid;

/// No NATS request may hold a page longer than this.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// How long to wait between connection attempts while NATS does not answer.
const RECONNECT_EVERY: Duration = Duration::from_secs(10);

/// An order's subject is read up to this many messages (an order has a handful; more means copies).
const MAX_ORDER_MESSAGES: usize = 1_000;

/// The NATS side of the console.
#[derive(Debug, Clone)]
pub(crate) struct StreamSource {
    name: String,
    prefix: String,
    state: Arc<RwLock<Connection>>,
}

#[derive(Debug)]
enum Connection {
    /// The console was set up without NATS.
    Disabled,
    /// Not connected (yet): why.
    Waiting(String),
    Ready(jetstream::Context),
}

/// The stream as the console shows it.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct StreamView {
    /// The stream's name.
    pub name: String,
    /// Whether the numbers below were read just now.
    pub available: bool,
    /// Why not, when not.
    pub reason: Option<String>,
    /// Messages stored.
    pub messages: u64,
    /// Bytes stored.
    pub bytes: u64,
    /// First sequence still stored.
    pub first_sequence: u64,
    /// Last sequence assigned.
    pub last_sequence: u64,
    /// The projections' durable consumers, by projection name (absent when the consumer is).
    pub consumers: Vec<ConsumerView>,
    /// The partition consumers of each partitioned projection (`<name>-p<K>of<P>`, or
    /// `<name>-s<K>of<P>` on a stream the server splits), with who holds each lease.
    pub partitions: BTreeMap<String, Vec<PartitionView>>,
}

/// One partition of a projection: its consumer and the instance holding its lease.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PartitionView {
    /// `<K>of<P>`.
    pub partition: String,
    /// Split by the server (the consumer filters on its partition) rather than by the instances.
    pub split_by_server: bool,
    /// Its durable consumer.
    pub consumer: ConsumerView,
    /// The instance whose lease holds it (`<pid>-<random>`), when the instances share the
    /// partitions through leases and one holds it now.
    pub owner: Option<String>,
}

/// `<K>of<P>` and whether the server splits, for a partition consumer `<projection>-[ps]<K>of<P>`.
fn partition_of_consumer(projection: &str, consumer: &str) -> Option<(String, bool)> {
    let rest = consumer.strip_prefix(projection)?.strip_prefix('-')?;
    let (by_server, label) = match rest.split_at_checked(1)? {
        ("s", label) => (true, label),
        ("p", label) => (false, label),
        _ => return None,
    };
    let (k, p) = label.split_once("of")?;
    let numbers = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    (numbers(k) && numbers(p)).then(|| (label.to_owned(), by_server))
}

/// One durable consumer's position.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ConsumerView {
    /// The consumer (= the projection's name).
    pub name: String,
    /// Whether the consumer exists.
    pub found: bool,
    /// Messages in the stream not yet delivered to it.
    pub num_pending: u64,
    /// Delivered, not yet acknowledged.
    pub num_ack_pending: u64,
    /// Redelivered messages outstanding.
    pub num_redelivered: u64,
    /// The stream sequence below which everything is acknowledged.
    pub ack_floor: u64,
}

impl ConsumerView {
    fn of(name: &str, info: &jetstream::consumer::Info) -> Self {
        Self {
            name: name.to_owned(),
            found: true,
            num_pending: info.num_pending,
            num_ack_pending: info.num_ack_pending as u64,
            num_redelivered: info.num_redelivered as u64,
            ack_floor: info.ack_floor.stream_sequence,
        }
    }

    fn missing(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            found: false,
            num_pending: 0,
            num_ack_pending: 0,
            num_redelivered: 0,
            ack_floor: 0,
        }
    }

    /// Messages the projection has not settled yet: undelivered plus unacknowledged.
    pub(crate) fn lag(&self) -> u64 {
        self.num_pending + self.num_ack_pending
    }
}

/// One message found on an order's subject.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct StreamCopy {
    /// Its stream sequence.
    pub sequence: u64,
    /// Its `Nats-Msg-Id` (the event id, when the relay published it).
    pub msg_id: Option<String>,
}

impl StreamSource {
    /// A source for `stream` under `prefix`; with `nats`, connects in the background (and keeps
    /// trying every few seconds while NATS does not answer).
    pub(crate) fn start(nats: Option<ops::NatsConnection>, stream: String, prefix: String) -> Self {
        let initial = match &nats {
            None => Connection::Disabled,
            Some(_) => Connection::Waiting("connecting to NATS…".to_owned()),
        };
        let source = Self {
            name: stream,
            prefix,
            state: Arc::new(RwLock::new(initial)),
        };
        if let Some(nats) = nats {
            let state = Arc::clone(&source.state);
            tokio::spawn(async move {
                loop {
                    match nats.connect("waybill-console").await {
                        Ok(client) => {
                            tracing::info!(nats = %nats.shown(), "console connected to NATS");
                            set(&state, Connection::Ready(jetstream::new(client)));
                            // The client reconnects by itself from here on; requests fail meanwhile.
                            return;
                        }
                        Err(error) => {
                            let reason = format!("{error:#}");
                            tracing::warn!(nats = %nats.shown(), error = %reason, retry_in_s = RECONNECT_EVERY.as_secs(), "console cannot reach NATS");
                            set(&state, Connection::Waiting(reason));
                            tokio::time::sleep(RECONNECT_EVERY).await;
                        }
                    }
                }
            });
        }
        source
    }

    fn context(&self) -> Result<jetstream::Context, String> {
        let state = self
            .state
            .read()
            .map_err(|_| "the NATS connection state is unreadable".to_owned())?;
        match &*state {
            Connection::Disabled => Err("NATS is not configured for this console".to_owned()),
            Connection::Waiting(reason) => Err(format!("NATS unavailable: {reason}")),
            Connection::Ready(context) => Ok(context.clone()),
        }
    }

    /// The stream's state and the named durable consumers. Never fails: an unavailable stream is a
    /// view that says why.
    pub(crate) async fn view(&self, consumers: &[&str]) -> StreamView {
        let partitions = self.partitions(consumers).await;
        let mut view = StreamView {
            name: self.name.clone(),
            ..StreamView::default()
        };
        match self.read(consumers).await {
            Ok((state, found)) => {
                view.available = true;
                view.messages = state.messages;
                view.bytes = state.bytes;
                view.first_sequence = state.first_sequence;
                view.last_sequence = state.last_sequence;
                view.consumers = found;
                view.partitions = partitions;
            }
            Err(reason) => view.reason = Some(reason),
        }
        view
    }

    /// Each of `projections`' partition consumers on the stream, and the lease holders from the
    /// projection's lease bucket (`projections::lease`). Empty when nothing can be read.
    async fn partitions(&self, projections: &[&str]) -> BTreeMap<String, Vec<PartitionView>> {
        let mut found: BTreeMap<String, Vec<PartitionView>> = BTreeMap::new();
        let Ok(context) = self.context() else {
            return found;
        };
        let Ok(Ok(stream)) =
            timed(context.get_stream_no_info(&self.name), "finding the stream").await
        else {
            return found;
        };
        let mut names = stream.consumer_names();
        let mut consumers = Vec::new();
        while let Ok(Some(Ok(name))) = timed(names.next(), "listing the consumers").await {
            consumers.push(name);
        }
        for projection in projections {
            let mut theirs: Vec<(String, String, bool)> = consumers
                .iter()
                .filter_map(|name| {
                    partition_of_consumer(projection, name)
                        .map(|(label, by_server)| (name.clone(), label, by_server))
                })
                .collect();
            if theirs.is_empty() {
                continue;
            }
            theirs.sort_by(|a, b| a.1.cmp(&b.1));
            let bucket = projections::lease::bucket_name(&self.name, projection);
            let leases = timed(context.get_key_value(&bucket), "opening the leases")
                .await
                .ok()
                .and_then(Result::ok);
            let mut views = Vec::with_capacity(theirs.len());
            for (name, label, by_server) in theirs {
                let info = timed(stream.consumer_info(&name), "reading a consumer").await;
                let consumer = match info {
                    Ok(Ok(info)) => ConsumerView::of(&name, &info),
                    _ => ConsumerView::missing(&name),
                };
                let owner = match &leases {
                    Some(store) => {
                        match timed(store.get(format!("owner.{label}")), "reading a lease").await {
                            Ok(Ok(Some(value))) => {
                                Some(String::from_utf8_lossy(&value).into_owned())
                            }
                            _ => None,
                        }
                    }
                    None => None,
                };
                views.push(PartitionView {
                    partition: label,
                    split_by_server: by_server,
                    consumer,
                    owner,
                });
            }
            found.insert((*projection).to_owned(), views);
        }
        found
    }

    async fn read(
        &self,
        consumers: &[&str],
    ) -> Result<(jetstream::stream::State, Vec<ConsumerView>), String> {
        let context = self.context()?;
        let mut stream = timed(context.get_stream(&self.name), "reading the stream")
            .await?
            .map_err(|e| format!("stream {}: {e}", self.name))?;
        let state = timed(stream.info(), "reading the stream's state")
            .await?
            .map_err(|e| format!("stream {}: {e}", self.name))?
            .state
            .clone();
        let mut found = Vec::with_capacity(consumers.len());
        for name in consumers {
            let info = timed(stream.consumer_info(name), "reading a consumer").await?;
            found.push(match info {
                Ok(info) => ConsumerView::of(name, &info),
                Err(_) => ConsumerView::missing(name),
            });
        }
        Ok((state, found))
    }

    /// Every message on the order's subject, in stream order, read by an ordered consumer (no
    /// acknowledgements, nothing left behind but an ephemeral consumer the server removes).
    pub(crate) async fn order_messages(&self, order: Uuid) -> Result<Vec<StreamCopy>, String> {
        let context = self.context()?;
        let stream = timed(context.get_stream(&self.name), "finding the stream")
            .await?
            .map_err(|e| format!("stream {}: {e}", self.name))?;
        // A stream the server splits into partitions stores the order under its partition's subject.
        let partitions = ops::stream_partitions(&stream.cached_info().config, &self.prefix);
        let subject =
            domain::wire::stored_subject(&self.prefix, domain::AGGREGATE_TYPE, order, partitions)?;
        // Empty subjects are answered by the stream's per-subject index without a consumer.
        match timed(
            stream.get_last_raw_message_by_subject(&subject),
            "reading the subject",
        )
        .await?
        {
            Ok(_) => {}
            Err(error)
                if error.kind() == jetstream::stream::LastRawMessageErrorKind::NoMessageFound =>
            {
                return Ok(Vec::new());
            }
            Err(error) => return Err(format!("reading {subject}: {error}")),
        }
        let consumer = timed(
            stream.create_consumer(pull::OrderedConfig {
                filter_subject: subject.clone(),
                deliver_policy: DeliverPolicy::All,
                headers_only: true,
                ..Default::default()
            }),
            "creating a reader",
        )
        .await?
        .map_err(|e| format!("reading {subject}: {e}"))?;
        let mut messages = timed(consumer.messages(), "opening the reader")
            .await?
            .map_err(|e| format!("reading {subject}: {e}"))?;
        let mut copies = Vec::new();
        while copies.len() < MAX_ORDER_MESSAGES {
            let message = match timed(messages.next(), "reading the subject").await? {
                Some(Ok(message)) => message,
                Some(Err(e)) => return Err(format!("reading {subject}: {e}")),
                None => break,
            };
            let info = message
                .info()
                .map_err(|e| format!("reading {subject}: {e}"))?;
            let (sequence, pending) = (info.stream_sequence, info.pending);
            copies.push(StreamCopy {
                sequence,
                msg_id: message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get(domain::wire::MSG_ID))
                    .map(|v| v.as_str().to_owned()),
            });
            if pending == 0 {
                break;
            }
        }
        Ok(copies)
    }
}

fn set(state: &RwLock<Connection>, value: Connection) {
    if let Ok(mut guard) = state.write() {
        *guard = value;
    }
}

/// Runs `future` for at most [`REQUEST_TIMEOUT`]; a timeout is an error naming `what`.
async fn timed<T>(future: impl Future<Output = T>, what: &str) -> Result<T, String> {
    tokio::time::timeout(REQUEST_TIMEOUT, future)
        .await
        .map_err(|_| format!("{what} timed out after {} s", REQUEST_TIMEOUT.as_secs()))
}
