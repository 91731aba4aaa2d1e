//! The call's deadline, read from `grpc-timeout`. tonic applies that header
//! only to the response headers; a streaming body is ours to bound.

use std::time::Duration;

use tonic::metadata::MetadataMap;

/// The `grpc-timeout` of a call: `Ok(None)` when absent, `Err` when malformed.
pub fn from_metadata(md: &MetadataMap) -> Result<Option<Duration>, &'static str> {
    let Some(v) = md.get("grpc-timeout") else {
        return Ok(None);
    };
    let s = v.to_str().map_err(|_| "grpc-timeout is not ASCII")?;
    parse(s).map(Some)
}

/// Parses the gRPC timeout format: 1-8 digits and a unit (H, M, S, m, u, n).
pub fn parse(s: &str) -> Result<Duration, &'static str> {
    const MALFORMED: &str = "grpc-timeout must be 1-8 digits and a unit (H M S m u n)";
    if s.len() < 2 || s.len() > 9 {
        return Err(MALFORMED);
    }
    let (digits, unit) = s.split_at(s.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(MALFORMED);
    }
    let n: u64 = digits.parse().map_err(|_| MALFORMED)?;
    Ok(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return Err(MALFORMED),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit_and_rejects_bad_values() {
        assert_eq!(parse("2H"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse("3M"), Ok(Duration::from_secs(180)));
        assert_eq!(parse("30S"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("250m"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("99999999u"), Ok(Duration::from_micros(99_999_999)));
        assert_eq!(parse("5n"), Ok(Duration::from_nanos(5)));
        for bad in ["", "S", "123456789S", "10x", "-1S", "1.5S"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
