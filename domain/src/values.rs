//! Validated value types: an invalid order id, SKU, quantity, amount or currency cannot be constructed.
//!
//! Every type has a `parse` (or checked) constructor that says exactly what is wrong, and deserializes
//! through the same check, so a value read from JSON is as trustworthy as one typed by a user.

use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Why a value was refused. The message names the field and the rule it broke.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {value:?} is invalid: {rule}")]
pub struct ValueError {
    /// Which kind of value it was (`order id`, `sku`, ...).
    pub field: &'static str,
    /// What the caller gave, verbatim (truncated when very long).
    pub value: String,
    /// The rule it broke, in words.
    pub rule: &'static str,
}

impl ValueError {
    fn new(field: &'static str, value: impl fmt::Display, rule: &'static str) -> Self {
        let mut value = value.to_string();
        if value.len() > 80 {
            let cut = (0..=80)
                .rev()
                .find(|i| value.is_char_boundary(*i))
                .unwrap_or(0);
            value.truncate(cut);
            value.push('…');
        }
        Self { field, value, rule }
    }
}

/// The identity of one order aggregate (a UUID; new ones are v7, chosen outside the domain).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct OrderId(Uuid);

impl OrderId {
    /// Wraps an id chosen by the caller (the domain never generates ids itself).
    pub fn from_uuid(id: Uuid) -> Self {
        Self(id)
    }

    /// Parses the textual form a user types.
    pub fn parse(text: &str) -> Result<Self, ValueError> {
        Uuid::parse_str(text.trim())
            .map(Self)
            .map_err(|_| ValueError::new("order id", text, "it must be a UUID"))
    }

    /// The underlying UUID.
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl crate::aggregate::AggregateId for OrderId {
    fn from_uuid(id: Uuid) -> Self {
        Self(id)
    }

    fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl fmt::Display for OrderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Checks a short identifier: 1..=max characters from `[A-Za-z0-9._:-]` (or upper-case only).
fn check_token(
    field: &'static str,
    text: &str,
    max: usize,
    upper_only: bool,
) -> Result<(), ValueError> {
    if text.is_empty() {
        return Err(ValueError::new(field, text, "it must not be empty"));
    }
    if text.chars().count() > max {
        return Err(ValueError::new(field, text, "it is too long"));
    }
    let allowed = |c: char| {
        if upper_only {
            c.is_ascii_uppercase() || c.is_ascii_digit() || c == '-' || c == '_'
        } else {
            c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':')
        }
    };
    if !text.chars().all(allowed) {
        let rule = if upper_only {
            "use only A-Z, 0-9, '-' and '_'"
        } else {
            "use only letters, digits, '-', '_', '.' and ':'"
        };
        return Err(ValueError::new(field, text, rule));
    }
    Ok(())
}

/// Declares a string newtype whose only constructor is a validating `parse`.
macro_rules! validated_text {
    ($(#[$doc:meta])* $name:ident, $check:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// Validates `text`; the error says which rule it broke.
            pub fn parse(text: &str) -> Result<Self, ValueError> {
                let check: fn(&str) -> Result<(), ValueError> = $check;
                check(text)?;
                Ok(Self(text.to_owned()))
            }

            /// The validated text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = ValueError;
            fn try_from(text: String) -> Result<Self, ValueError> {
                Self::parse(&text)
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

validated_text!(
    /// Who placed the order: 1–64 characters from `[A-Za-z0-9._:-]`.
    CustomerId,
    |t| check_token("customer id", t, 64, false)
);

validated_text!(
    /// A stock-keeping unit: 1–32 characters from `[A-Z0-9_-]`, e.g. `MUG-BLUE`.
    Sku,
    |t| check_token("sku", t, 32, true)
);

/// The active ISO 4217 alphabetic codes (currencies, funds, precious metals, `XTS` for tests and `XXX`
/// for "no currency"), sorted so membership is a binary search. Withdrawn codes (`HRK`, `ZWL`, `SLL`, …)
/// are not accepted for new orders.
pub const ISO_4217: &[&str] = &[
    "AED", "AFN", "ALL", "AMD", "ANG", "AOA", "ARS", "AUD", "AWG", "AZN", "BAM", "BBD", "BDT",
    "BGN", "BHD", "BIF", "BMD", "BND", "BOB", "BOV", "BRL", "BSD", "BTN", "BWP", "BYN", "BZD",
    "CAD", "CDF", "CHE", "CHF", "CHW", "CLF", "CLP", "CNY", "COP", "COU", "CRC", "CUP", "CVE",
    "CZK", "DJF", "DKK", "DOP", "DZD", "EGP", "ERN", "ETB", "EUR", "FJD", "FKP", "GBP", "GEL",
    "GHS", "GIP", "GMD", "GNF", "GTQ", "GYD", "HKD", "HNL", "HTG", "HUF", "IDR", "ILS", "INR",
    "IQD", "IRR", "ISK", "JMD", "JOD", "JPY", "KES", "KGS", "KHR", "KMF", "KPW", "KRW", "KWD",
    "KYD", "KZT", "LAK", "LBP", "LKR", "LRD", "LSL", "LYD", "MAD", "MDL", "MGA", "MKD", "MMK",
    "MNT", "MOP", "MRU", "MUR", "MVR", "MWK", "MXN", "MXV", "MYR", "MZN", "NAD", "NGN", "NIO",
    "NOK", "NPR", "NZD", "OMR", "PAB", "PEN", "PGK", "PHP", "PKR", "PLN", "PYG", "QAR", "RON",
    "RSD", "RUB", "RWF", "SAR", "SBD", "SCR", "SDG", "SEK", "SGD", "SHP", "SLE", "SOS", "SRD",
    "SSP", "STN", "SVC", "SYP", "SZL", "THB", "TJS", "TMT", "TND", "TOP", "TRY", "TTD", "TWD",
    "TZS", "UAH", "UGX", "USD", "USN", "UYI", "UYU", "UYW", "UZS", "VED", "VES", "VND", "VUV",
    "WST", "XAF", "XAG", "XAU", "XBA", "XBB", "XBC", "XBD", "XCD", "XCG", "XDR", "XOF", "XPD",
    "XPF", "XPT", "XSU", "XTS", "XUA", "XXX", "YER", "ZAR", "ZMW", "ZWG",
];

/// An ISO 4217 currency code, e.g. `EUR`.
///
/// [`Currency::parse`] (every new order, over HTTP and the command line) accepts only the active codes of
/// [`ISO_4217`]. Deserializing checks only the shape (three upper-case letters): a recorded event is
/// history, and an order placed before the list was enforced, or in a currency withdrawn since, must
/// still load.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Currency(String);

impl Currency {
    /// Accepts an active ISO 4217 code; the error says which rule the text broke.
    pub fn parse(text: &str) -> Result<Self, ValueError> {
        let currency = Self::recorded(text)?;
        if ISO_4217.binary_search(&text).is_err() {
            return Err(ValueError::new(
                "currency",
                text,
                "it must be an active ISO 4217 currency code, like EUR",
            ));
        }
        Ok(currency)
    }

    /// The shape check alone, for codes read back from history.
    fn recorded(text: &str) -> Result<Self, ValueError> {
        if text.len() == 3 && text.chars().all(|c| c.is_ascii_uppercase()) {
            Ok(Self(text.to_owned()))
        } else {
            Err(ValueError::new(
                "currency",
                text,
                "it must be three upper-case letters, like EUR",
            ))
        }
    }

    /// The code.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Currency {
    type Error = ValueError;
    fn try_from(text: String) -> Result<Self, ValueError> {
        Self::recorded(&text)
    }
}

impl From<Currency> for String {
    fn from(value: Currency) -> String {
        value.0
    }
}

impl fmt::Display for Currency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

validated_text!(
    /// Free text a person wrote (a cancel reason, a carrier, a tracking number, a payment reference):
    /// at most 200 characters, no control characters.
    Note,
    |t| {
        if t.chars().count() > 200 {
            Err(ValueError::new("text", t, "it is longer than 200 characters"))
        } else if t.chars().any(char::is_control) {
            Err(ValueError::new("text", t, "it contains control characters"))
        } else {
            Ok(())
        }
    }
);

impl Note {
    /// Like [`Note::parse`], but also refuses an empty or blank text, naming `field`.
    pub fn required(field: &'static str, text: &str) -> Result<Self, ValueError> {
        if text.trim().is_empty() {
            return Err(ValueError::new(field, text, "it must not be empty"));
        }
        Self::parse(text).map_err(|e| ValueError { field, ..e })
    }
}

/// How many units of a SKU: 1 to 1,000,000.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "i64", into = "i64")]
pub struct Quantity(u32);

impl Quantity {
    /// The largest quantity one line may carry; keeps every total far from overflow.
    pub const MAX: u32 = 1_000_000;

    /// Accepts 1..=[`Quantity::MAX`].
    pub fn new(units: i64) -> Result<Self, ValueError> {
        match u32::try_from(units) {
            Ok(n) if (1..=Self::MAX).contains(&n) => Ok(Self(n)),
            _ if units <= 0 => Err(ValueError::new("quantity", units, "it must be at least 1")),
            _ => Err(ValueError::new(
                "quantity",
                units,
                "it must be at most 1000000",
            )),
        }
    }

    /// Parses the decimal form a user types.
    pub fn parse(text: &str) -> Result<Self, ValueError> {
        let units = text
            .trim()
            .parse::<i64>()
            .map_err(|_| ValueError::new("quantity", text, "it must be a whole number"))?;
        Self::new(units)
    }

    /// The number of units.
    pub fn get(self) -> u32 {
        self.0
    }
}

impl TryFrom<i64> for Quantity {
    type Error = ValueError;
    fn try_from(units: i64) -> Result<Self, ValueError> {
        Self::new(units)
    }
}

impl From<Quantity> for i64 {
    fn from(q: Quantity) -> i64 {
        i64::from(q.0)
    }
}

/// A positive amount of money in the smallest unit of its currency (cents), at most 10^12.
///
/// [`Cents::MAX`] is the one bound on money: a unit price, a payment and an order's total (checked when
/// the order is placed), so every order that is accepted can be paid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "i64", into = "i64")]
pub struct Cents(i64);

impl Cents {
    /// The largest amount accepted (ten billion in major units), for prices, payments and order totals.
    pub const MAX: i64 = 1_000_000_000_000;

    /// Accepts 1..=[`Cents::MAX`].
    pub fn new(cents: i64) -> Result<Self, ValueError> {
        if cents <= 0 {
            Err(ValueError::new(
                "amount",
                cents,
                "it must be a positive number of cents",
            ))
        } else if cents > Self::MAX {
            Err(ValueError::new(
                "amount",
                cents,
                "it must be at most 10^12 cents",
            ))
        } else {
            Ok(Self(cents))
        }
    }

    /// Parses the decimal number of cents a user types.
    pub fn parse(text: &str) -> Result<Self, ValueError> {
        let cents = text
            .trim()
            .parse::<i64>()
            .map_err(|_| ValueError::new("amount", text, "it must be a whole number of cents"))?;
        Self::new(cents)
    }

    /// The amount in cents.
    pub fn get(self) -> i64 {
        self.0
    }
}

impl TryFrom<i64> for Cents {
    type Error = ValueError;
    fn try_from(cents: i64) -> Result<Self, ValueError> {
        Self::new(cents)
    }
}

impl From<Cents> for i64 {
    fn from(c: Cents) -> i64 {
        c.0
    }
}

/// One line of an order: a SKU, how many, and the price of one unit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OrderLine {
    /// What is ordered.
    pub sku: Sku,
    /// How many units.
    pub quantity: Quantity,
    /// The price of one unit, in cents.
    pub unit_price_cents: Cents,
}

impl OrderLine {
    /// Parses the command-line form `SKU:QTY:UNIT_PRICE_CENTS`, e.g. `MUG-BLUE:2:1250`.
    pub fn parse(text: &str) -> Result<Self, ValueError> {
        let parts: Vec<&str> = text.split(':').collect();
        let [sku, quantity, price] = parts[..] else {
            return Err(ValueError::new(
                "line",
                text,
                "write it as SKU:QUANTITY:UNIT_PRICE_CENTS",
            ));
        };
        Ok(Self {
            sku: Sku::parse(sku)?,
            quantity: Quantity::parse(quantity)?,
            unit_price_cents: Cents::parse(price)?,
        })
    }

    /// Quantity × unit price; `None` only if it would overflow (impossible within the value bounds).
    pub fn subtotal_cents(&self) -> Option<i64> {
        i64::from(self.quantity.get()).checked_mul(self.unit_price_cents.get())
    }
}

/// Where an order was placed: its sales channel (`order.placed` v3). Orders placed before channels
/// were recorded are read as [`Channel::Web`], the only channel the shop had then.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Channel {
    /// The web shop (and every order from before v3).
    #[default]
    Web,
    /// The mobile app.
    App,
    /// A physical store's till.
    Store,
    /// Taken by phone.
    Phone,
    /// A third-party marketplace.
    Marketplace,
}

impl Channel {
    /// Every channel, as written in payloads and on the command line.
    pub const ALL: [Channel; 5] = [
        Self::Web,
        Self::App,
        Self::Store,
        Self::Phone,
        Self::Marketplace,
    ];

    /// The name in payloads: `web`, `app`, `store`, `phone`, `marketplace`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Web => "web",
            Self::App => "app",
            Self::Store => "store",
            Self::Phone => "phone",
            Self::Marketplace => "marketplace",
        }
    }

    /// Accepts one of the names of [`Channel::ALL`].
    pub fn parse(text: &str) -> Result<Self, ValueError> {
        Self::ALL
            .into_iter()
            .find(|c| c.as_str() == text)
            .ok_or_else(|| {
                ValueError::new(
                    "channel",
                    text,
                    "it must be one of web, app, store, phone, marketplace",
                )
            })
    }
}

impl fmt::Display for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_parse_by_their_payload_names_only() {
        for channel in Channel::ALL {
            assert_eq!(Channel::parse(channel.as_str()), Ok(channel));
            assert_eq!(
                serde_json::to_value(channel).expect("encodes"),
                serde_json::json!(channel.as_str())
            );
        }
        for bad in ["", "Web", "WEB", "fax", "web\0"] {
            assert!(Channel::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_well_formed_line_parses() {
        let line = OrderLine::parse("MUG-BLUE:2:1250").expect("valid line");
        assert_eq!(line.sku.as_str(), "MUG-BLUE");
        assert_eq!(line.quantity.get(), 2);
        assert_eq!(line.subtotal_cents(), Some(2500));
    }

    #[test]
    fn malformed_skus_are_refused_with_the_rule() {
        for bad in [
            "",
            "mug",
            "MUG BLUE",
            "MUG!",
            "A23456789012345678901234567890123",
        ] {
            let err = Sku::parse(bad).expect_err(bad);
            assert_eq!(err.field, "sku", "{bad}");
        }
    }

    #[test]
    fn zero_or_negative_quantities_are_refused() {
        assert!(Quantity::new(0).is_err());
        assert!(Quantity::new(-3).is_err());
        assert!(Quantity::new(1_000_001).is_err());
        assert!(Quantity::parse("two").is_err());
        assert_eq!(Quantity::new(1_000_000).map(Quantity::get), Ok(1_000_000));
    }

    #[test]
    fn non_positive_prices_are_refused() {
        assert!(Cents::new(0).is_err());
        assert!(Cents::new(-1).is_err());
        assert!(OrderLine::parse("MUG:1:0").is_err());
        assert!(OrderLine::parse("MUG:1:-5").is_err());
    }

    #[test]
    fn a_line_needs_exactly_three_parts() {
        let err = OrderLine::parse("MUG:1").expect_err("two parts");
        assert!(
            err.to_string().contains("SKU:QUANTITY:UNIT_PRICE_CENTS"),
            "{err}"
        );
    }

    #[test]
    fn currencies_are_active_iso_4217_codes() {
        for good in ["EUR", "USD", "JPY", "CHF", "XXX", "ZWG"] {
            assert!(Currency::parse(good).is_ok(), "{good}");
        }
        for bad in ["eur", "EURO", "E1R", "", "ZZZ", "ABC", "HRK"] {
            assert!(Currency::parse(bad).is_err(), "{bad}");
        }
        let err = Currency::parse("ZZZ").expect_err("not a currency");
        assert!(err.to_string().contains("ISO 4217"), "{err}");
    }

    #[test]
    fn the_currency_list_is_sorted_and_unique() {
        // Binary search needs it; a duplicate would hide a typo.
        assert!(ISO_4217.windows(2).all(|w| w[0] < w[1]));
        assert!(ISO_4217.iter().all(|c| Currency::recorded(c).is_ok()));
    }

    #[test]
    fn a_recorded_currency_loads_even_if_no_longer_accepted() {
        let old: Currency = serde_json::from_str("\"HRK\"").expect("history loads");
        assert_eq!(old.as_str(), "HRK");
        assert!(serde_json::from_str::<Currency>("\"eur\"").is_err());
    }

    #[test]
    fn values_deserialize_through_their_checks() {
        assert!(serde_json::from_str::<Quantity>("0").is_err());
        assert!(serde_json::from_str::<Sku>("\"bad sku\"").is_err());
        assert!(serde_json::from_str::<Cents>("12").is_ok());
    }

    #[test]
    fn long_values_are_truncated_in_messages() {
        let err = CustomerId::parse(&"x".repeat(500)).expect_err("too long");
        assert!(err.to_string().len() < 200, "{err}");
    }

    #[test]
    fn required_notes_refuse_blank_text() {
        let err = Note::required("carrier", "  ").expect_err("blank");
        assert_eq!(err.field, "carrier");
        assert!(Note::parse("").is_ok());
    }
}
