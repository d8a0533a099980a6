//! How durations appear in JSON (events, statistics, bench reports, traces): as microseconds
//! with the nanoseconds as three decimals, in fields named `*_us`. Exact both ways, so a
//! trace reads back the very durations the run measured. Used as `#[serde(with = …)]`.

/// Microseconds, nanosecond-exact.
pub mod micros {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    /// Writes `d` as microseconds, with the nanoseconds as three decimals.
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_nanos() as f64 / 1e3)
    }

    /// Reads microseconds back to the nanosecond; errs on a negative, non-finite or too large
    /// value.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let us = f64::deserialize(d)?;
        if !(0.0..1.8e16).contains(&us) {
            return Err(D::Error::custom(format!("{us} µs is not a duration")));
        }
        Ok(Duration::from_nanos((us * 1e3).round() as u64))
    }
}
