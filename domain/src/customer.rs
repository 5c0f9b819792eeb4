//! The customer: the second aggregate type, beside the order. A customer is registered under the
//! handle orders already carry (`customer_id`, e.g. `alice`) with a display name, and may be renamed.
//! Its aggregate id is derived from the handle (UUID v5), so `GET /customers/alice` needs no lookup
//! and two registrations of one handle collide on the event store's unique version.
//!
//! Events: `customer.registered` v1 `{customer_id, name}`, `customer.renamed` v1 `{name}`; like
//! every payload type, each is `#[non_exhaustive]` and built by its `from_command` alone.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::aggregate::{Aggregate, AggregateId, Command, DomainError, DomainEvent, Refusal};
use crate::catalog::PayloadSchema;
use crate::event::PayloadError;
use crate::upcast::Upcasters;
use crate::values::{CustomerId, Note, ValueError};

/// A customer's aggregate id: UUID v5 of its handle in [`CustomerKey::NAMESPACE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CustomerKey(Uuid);

impl CustomerKey {
    /// The namespace of customer ids (a fixed random UUID; changing it changes every customer's id).
    pub const NAMESPACE: Uuid = Uuid::from_u128(0x6a1c_3f0e_9b5d_4c27_8e41_0d2f_7a93_b5c8);

    /// The id of the customer with `handle`.
    pub fn of(handle: &CustomerId) -> Self {
        Self(Uuid::new_v5(&Self::NAMESPACE, handle.as_str().as_bytes()))
    }
}

impl AggregateId for CustomerKey {
    fn from_uuid(id: Uuid) -> Self {
        Self(id)
    }

    fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl fmt::Display for CustomerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// `customer.registered`, version 1: a handle and the name to show for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct CustomerRegistered {
    /// The handle orders carry as their `customer_id`.
    pub customer_id: CustomerId,
    /// The name to show.
    pub name: Note,
}

impl CustomerRegistered {
    /// The event an accepted register command records. The one place a `CustomerRegistered` is
    /// built: a new field with a default is set here alone.
    pub fn from_command(register: &RegisterCustomer) -> Self {
        Self {
            customer_id: register.customer_id.clone(),
            name: register.name.clone(),
        }
    }
}

/// `customer.renamed`, version 1: a new name to show.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct CustomerRenamed {
    /// The new name.
    pub name: Note,
}

impl CustomerRenamed {
    /// The event an accepted rename command records. The one place a `CustomerRenamed` is built.
    pub fn from_command(rename: &RenameCustomer) -> Self {
        Self {
            name: rename.name.clone(),
        }
    }
}

/// Something that happened to a customer, in the current shape of its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CustomerEvent {
    /// See [`CustomerRegistered`].
    Registered(CustomerRegistered),
    /// See [`CustomerRenamed`].
    Renamed(CustomerRenamed),
}

impl CustomerEvent {
    /// Event type name of [`CustomerRegistered`].
    pub const REGISTERED: &'static str = "customer.registered";
    /// Event type name of [`CustomerRenamed`].
    pub const RENAMED: &'static str = "customer.renamed";
}

impl DomainEvent for CustomerEvent {
    const CURRENT_VERSIONS: &'static [(&'static str, i32)] =
        &[(Self::REGISTERED, 1), (Self::RENAMED, 1)];

    fn event_type(&self) -> &'static str {
        match self {
            Self::Registered(_) => Self::REGISTERED,
            Self::Renamed(_) => Self::RENAMED,
        }
    }

    fn to_payload(&self) -> Value {
        let encoded = match self {
            Self::Registered(e) => serde_json::to_value(e),
            Self::Renamed(e) => serde_json::to_value(e),
        };
        encoded.expect("customer payloads are structs of strings; serializing them cannot fail")
    }

    fn from_payload(event_type: &str, payload: Value) -> Result<Self, PayloadError> {
        let shape = |source| PayloadError::Shape {
            event_type: event_type.to_owned(),
            source,
        };
        match event_type {
            Self::REGISTERED => serde_json::from_value(payload).map(Self::Registered),
            Self::RENAMED => serde_json::from_value(payload).map(Self::Renamed),
            other => return Err(PayloadError::UnknownType(other.to_owned())),
        }
        .map_err(shape)
    }
}

/// Register a customer under a handle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RegisterCustomer {
    /// The handle.
    pub customer_id: CustomerId,
    /// The name to show (required).
    pub name: Note,
}

/// Give a registered customer a new name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RenameCustomer {
    /// The new name (required).
    pub name: Note,
}

/// Something a caller asks a customer to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "command", rename_all = "snake_case")]
pub enum CustomerCommand {
    /// See [`RegisterCustomer`].
    Register(RegisterCustomer),
    /// See [`RenameCustomer`].
    Rename(RenameCustomer),
}

impl Command for CustomerCommand {
    type Aggregate = Customer;

    fn verb(&self) -> &'static str {
        match self {
            Self::Register(_) => "register",
            Self::Rename(_) => "rename",
        }
    }

    fn creates(&self) -> bool {
        matches!(self, Self::Register(_))
    }
}

/// Why a customer command was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CustomerError {
    /// Rename of a customer never registered.
    #[error("customer {0} not found")]
    NotFound(CustomerKey),
    /// Register of a handle already taken.
    #[error("customer {0} is already registered")]
    AlreadyRegistered(String),
    /// The register command's handle does not belong to this aggregate id.
    #[error("customer id {handle} does not belong to aggregate {key}")]
    WrongKey {
        /// The handle given.
        handle: String,
        /// The aggregate it was sent to.
        key: CustomerKey,
    },
    /// Renaming to the name it has.
    #[error("customer {0} already has that name")]
    SameName(String),
    /// A value inside the command was invalid.
    #[error(transparent)]
    InvalidValue(#[from] ValueError),
}

impl DomainError for CustomerError {
    fn refusal(&self) -> Refusal {
        match self {
            Self::NotFound(_) => Refusal::NotFound,
            Self::AlreadyRegistered(_) | Self::SameName(_) => Refusal::Conflict,
            Self::WrongKey { .. } | Self::InvalidValue(_) => Refusal::Invalid,
        }
    }
}

/// The folded state of one customer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Customer {
    /// Its aggregate id.
    pub key: CustomerKey,
    /// How many events it has applied.
    pub version: i64,
    /// Its handle (`None` until registered).
    pub customer_id: Option<CustomerId>,
    /// Its name (`None` until registered).
    pub name: Option<Note>,
}

impl Aggregate for Customer {
    const TYPE: &'static str = "customer";
    type Id = CustomerKey;
    type Event = CustomerEvent;
    type Command = CustomerCommand;
    type Error = CustomerError;

    fn new(key: CustomerKey) -> Self {
        Self {
            key,
            version: 0,
            customer_id: None,
            name: None,
        }
    }

    fn id(&self) -> CustomerKey {
        self.key
    }

    fn version(&self) -> i64 {
        self.version
    }

    fn decide(&self, command: &CustomerCommand) -> Result<Vec<CustomerEvent>, CustomerError> {
        let event = match command {
            CustomerCommand::Register(register) => {
                if let Some(handle) = &self.customer_id {
                    return Err(CustomerError::AlreadyRegistered(handle.to_string()));
                }
                if CustomerKey::of(&register.customer_id) != self.key {
                    return Err(CustomerError::WrongKey {
                        handle: register.customer_id.to_string(),
                        key: self.key,
                    });
                }
                CustomerEvent::Registered(CustomerRegistered::from_command(register))
            }
            CustomerCommand::Rename(rename) => match &self.customer_id {
                None => return Err(CustomerError::NotFound(self.key)),
                Some(handle) if self.name.as_ref() == Some(&rename.name) => {
                    return Err(CustomerError::SameName(handle.to_string()));
                }
                Some(_) => CustomerEvent::Renamed(CustomerRenamed::from_command(rename)),
            },
        };
        Ok(vec![event])
    }

    fn apply(mut self, event: &CustomerEvent) -> Self {
        self.version += 1;
        match event {
            CustomerEvent::Registered(registered) => {
                self.customer_id = Some(registered.customer_id.clone());
                self.name = Some(registered.name.clone());
            }
            CustomerEvent::Renamed(renamed) => self.name = Some(renamed.name.clone()),
        }
        self
    }

    fn not_found(key: CustomerKey) -> CustomerError {
        CustomerError::NotFound(key)
    }

    fn upcasters() -> Upcasters {
        Upcasters::for_events::<CustomerEvent>()
    }

    fn schemas() -> Vec<PayloadSchema> {
        let name = json!({"type": "string", "minLength": 1, "maxLength": 200});
        vec![
            PayloadSchema {
                event_type: CustomerEvent::REGISTERED,
                event_version: 1,
                schema: crate::catalog::object(
                    "customer.registered v1",
                    &["customer_id", "name"],
                    json!({
                        "customer_id": crate::catalog::customer_id(),
                        "name": name,
                    }),
                ),
            },
            PayloadSchema {
                event_type: CustomerEvent::RENAMED,
                event_version: 1,
                schema: crate::catalog::object(
                    "customer.renamed v1",
                    &["name"],
                    json!({"name": name}),
                ),
            },
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(text: &str) -> CustomerId {
        CustomerId::parse(text).expect("handle")
    }

    fn register(text: &str, name: &str) -> CustomerCommand {
        CustomerCommand::Register(RegisterCustomer {
            customer_id: handle(text),
            name: Note::required("name", name).expect("name"),
        })
    }

    fn rename(name: &str) -> CustomerCommand {
        CustomerCommand::Rename(RenameCustomer {
            name: Note::required("name", name).expect("name"),
        })
    }

    #[test]
    fn a_handle_always_has_the_same_id_and_two_handles_differ() {
        assert_eq!(
            CustomerKey::of(&handle("alice")),
            CustomerKey::of(&handle("alice"))
        );
        assert_ne!(
            CustomerKey::of(&handle("alice")),
            CustomerKey::of(&handle("bob"))
        );
    }

    #[test]
    fn the_id_of_a_handle_is_fixed_forever() {
        // The golden fixtures and every stored customer depend on it (UUID v5, RFC 9562).
        assert_eq!(
            CustomerKey::of(&handle("alice")).as_uuid().to_string(),
            "9fdbd8f5-2c1a-54d1-8f50-dce26a864907"
        );
    }

    #[test]
    fn register_then_rename() {
        let key = CustomerKey::of(&handle("alice"));
        let new = Customer::new(key);
        let events = new.decide(&register("alice", "Alice")).expect("register");
        let registered = Customer::fold(key, &events);
        assert_eq!(registered.version, 1);
        let renamed = registered.decide(&rename("Alice B.")).expect("rename");
        let customer = renamed.iter().fold(registered.clone(), |c, e| c.apply(e));
        assert_eq!(customer.name.as_ref().map(Note::as_str), Some("Alice B."));
        assert_eq!(
            customer.decide(&rename("Alice B.")),
            Err(CustomerError::SameName("alice".into()))
        );
    }

    #[test]
    fn refusals_say_what_is_wrong() {
        let key = CustomerKey::of(&handle("alice"));
        let new = Customer::new(key);
        assert_eq!(
            new.decide(&rename("x")).map_err(|e| e.refusal()),
            Err(Refusal::NotFound)
        );
        assert_eq!(
            new.decide(&register("bob", "Bob")).map_err(|e| e.refusal()),
            Err(Refusal::Invalid),
            "a handle sent to another handle's id"
        );
        let registered = Customer::fold(key, &new.decide(&register("alice", "A")).expect("ok"));
        assert_eq!(
            registered
                .decide(&register("alice", "A"))
                .map_err(|e| e.refusal()),
            Err(Refusal::Conflict)
        );
    }

    #[test]
    fn payloads_round_trip_and_every_type_has_a_version() {
        let events = [
            CustomerEvent::Registered(CustomerRegistered::from_command(&RegisterCustomer {
                customer_id: handle("alice"),
                name: Note::required("name", "Alice").expect("name"),
            })),
            CustomerEvent::Renamed(CustomerRenamed::from_command(&RenameCustomer {
                name: Note::required("name", "Al").expect("name"),
            })),
        ];
        for event in events {
            let back = CustomerEvent::from_payload(event.event_type(), event.to_payload())
                .expect("decodes");
            assert_eq!(back, event);
            assert_eq!(event.event_version(), 1);
        }
        assert!(CustomerEvent::from_payload("customer.deleted", json!({})).is_err());
    }
}
