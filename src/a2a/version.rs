//! The A2A-Version check for every binding.
//!
//! a2a-server-lf's JSON-RPC router refuses an unsupported `A2A-Version`
//! header, but a2a-grpc's service does not look at it. The handler's
//! authorizer hook sees the service parameters (HTTP headers or gRPC
//! metadata) of every call on either binding, so the check sits there.

use a2a::A2AError;
use a2a_server::{RequestAuthorizer, ServiceParams};

/// The major protocol version served.
pub const SUPPORTED_MAJOR: u32 = 1;

/// Refuses calls that ask for another major version. A call without the
/// header is, per the spec, a 0.3 call and refused too.
pub struct VersionCheck;

impl RequestAuthorizer for VersionCheck {
    fn authorize(&self, params: &ServiceParams, _task_id: Option<&str>) -> Result<(), A2AError> {
        check(params)
    }
}

pub fn check(params: &ServiceParams) -> Result<(), A2AError> {
    let requested = params
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(a2a::SVC_PARAM_VERSION))
        .and_then(|(_, v)| v.first())
        .map(|v| v.trim())
        .unwrap_or("0.3");
    let major = requested
        .split('.')
        .next()
        .and_then(|m| m.parse::<u32>().ok());
    if major == Some(SUPPORTED_MAJOR) {
        Ok(())
    } else {
        // The requested version is echoed by the crate's constructor; keep it
        // short and printable so the message stays safe to return.
        let shown: String = requested
            .chars()
            .filter(|c| c.is_ascii_graphic())
            .take(16)
            .collect();
        Err(A2AError::version_not_supported(&shown))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(v: Option<&str>) -> ServiceParams {
        let mut p = ServiceParams::new();
        if let Some(v) = v {
            p.insert("a2a-version".into(), vec![v.into()]);
        }
        p
    }

    #[test]
    fn version_one_passes_and_others_are_version_not_supported() {
        assert!(check(&params(Some("1.0"))).is_ok());
        assert!(check(&params(Some("1"))).is_ok());
        for bad in [Some("0.3"), Some("2.0"), Some("x"), None] {
            let e = check(&params(bad)).unwrap_err();
            assert_eq!(e.code, a2a::error_code::VERSION_NOT_SUPPORTED, "{bad:?}");
        }
    }
}
