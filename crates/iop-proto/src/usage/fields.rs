//! How a provider's usage fields are read: each on its own and leniently (a field of an
//! odd shape costs that field, never the whole observation), the ones read in every event
//! in place, without building the value first.

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// `Some` for a value of the expected shape, `None` for `null` or anything else (a
/// provider's odd field costs that field, not the whole observation).
pub fn lenient<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Shape<T> {
        Expected(T),
        Other(IgnoredAny),
    }
    Ok(match Option::<Shape<T>>::deserialize(deserializer)? {
        Some(Shape::Expected(value)) => Some(value),
        _ => None,
    })
}

/// One JSON value as the observer's fields read it: the shapes they take, and `Other`
/// for the rest, which is skipped without being built (arrays are only counted).
pub enum Skimmed<'de> {
    /// A non-negative integer.
    Count(u64),
    /// A string, borrowed from the document when it holds no escapes.
    Text(Cow<'de, str>),
    /// An array of this many elements.
    Elements(usize),
    Other,
}

/// Reads one value as [`Skimmed`], in place: unlike [`lenient`] it never buffers the value
/// first, so it suits what is read in every event.
pub fn skim<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Skimmed<'de>, D::Error> {
    struct Skim;
    impl<'de> Visitor<'de> for Skim {
        type Value = Skimmed<'de>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_u64<E>(self, n: u64) -> Result<Skimmed<'de>, E> {
            Ok(Skimmed::Count(n))
        }
        fn visit_i64<E>(self, n: i64) -> Result<Skimmed<'de>, E> {
            Ok(u64::try_from(n).map_or(Skimmed::Other, Skimmed::Count))
        }
        fn visit_f64<E>(self, _: f64) -> Result<Skimmed<'de>, E> {
            Ok(Skimmed::Other)
        }
        fn visit_bool<E>(self, _: bool) -> Result<Skimmed<'de>, E> {
            Ok(Skimmed::Other)
        }
        fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Skimmed<'de>, E> {
            Ok(Skimmed::Text(Cow::Borrowed(s)))
        }
        fn visit_str<E>(self, s: &str) -> Result<Skimmed<'de>, E> {
            Ok(Skimmed::Text(Cow::Owned(s.to_string())))
        }
        fn visit_unit<E>(self) -> Result<Skimmed<'de>, E> {
            Ok(Skimmed::Other)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Skimmed<'de>, A::Error> {
            let mut n = 0;
            while seq.next_element::<IgnoredAny>()?.is_some() {
                n += 1;
            }
            Ok(Skimmed::Elements(n))
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Skimmed<'de>, A::Error> {
            IgnoredAny.visit_map(map).map(|_| Skimmed::Other)
        }
    }
    deserializer.deserialize_any(Skim)
}

/// A token count: `Some` for a non-negative integer, `None` for anything else.
pub fn count<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    Ok(match skim(deserializer)? {
        Skimmed::Count(n) => Some(n),
        _ => None,
    })
}

/// A string: `Some`, `None` for anything else.
pub fn text<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Cow<'de, str>>, D::Error> {
    Ok(match skim(deserializer)? {
        Skimmed::Text(s) => Some(s),
        _ => None,
    })
}

/// An array's length: `Some` for an array, `None` for anything else.
pub fn element_count<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<usize>, D::Error> {
    Ok(match skim(deserializer)? {
        Skimmed::Elements(n) => Some(n),
        _ => None,
    })
}
