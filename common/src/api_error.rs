//! One readable line for a Kubernetes API error. kube's own text repeats the whole `Status`
//! struct (`ApiError: m: R (Status { status: Some(Failure), code: 403, message: "m", ... })`),
//! which is what an operator then reads in every Event and log line.

use std::fmt;

/// Displays a `kube::Error` as `message (HTTP code Reason)` for API errors, and as kube does
/// otherwise.
pub struct Describe<'a>(pub &'a kube::Error);

impl fmt::Display for Describe<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            kube::Error::Api(s) => {
                let message = if s.message.is_empty() {
                    "the API server refused the request"
                } else {
                    &s.message
                };
                write!(f, "{message} (HTTP {}", s.code)?;
                if !s.reason.is_empty() {
                    write!(f, " {}", s.reason)?;
                }
                write!(f, ")")
            }
            other => write!(f, "{other}"),
        }
    }
}

/// Whether `e` is the API server's answer with HTTP status `code`.
pub fn has_code(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// Whether `e` says the object does not exist (404).
pub fn is_not_found(e: &kube::Error) -> bool {
    has_code(e, 404)
}

/// Whether `e` is a conflict (409): the object exists already, or changed under a write.
pub fn is_conflict(e: &kube::Error) -> bool {
    has_code(e, 409)
}

/// Whether `e` is a refusal by RBAC (403).
pub fn is_forbidden(e: &kube::Error) -> bool {
    has_code(e, 403)
}

/// The error and its causes on one line, each cause once; a `kube::Error` in the chain is
/// described by [`Describe`] and ends it (its own causes repeat what it says).
pub fn one_line(err: &(dyn std::error::Error + 'static)) -> String {
    let text = |e: &(dyn std::error::Error + 'static)| match e.downcast_ref::<kube::Error>() {
        Some(k) => (Describe(k).to_string(), true),
        None => (e.to_string(), false),
    };
    let (mut line, mut last) = text(err);
    let mut cause = err.source();
    while let (false, Some(c)) = (last, cause) {
        let (t, end) = text(c);
        if !line.contains(&t) {
            line.push_str(": ");
            line.push_str(&t);
        }
        last = end;
        cause = c.source();
    }
    line.replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forbidden() -> kube::Error {
        let status: kube::core::Status = serde_json::from_value(serde_json::json!({
            "status": "Failure",
            "message": "virtualmachines.kubevirt.io \"vm1\" is forbidden: User \"x\" cannot get resource",
            "reason": "Forbidden",
            "code": 403
        }))
        .expect("a Status");
        kube::Error::Api(Box::new(status))
    }

    #[derive(Debug, thiserror::Error)]
    #[error("Harvester API: reading VM vm1: {}", Describe(.0))]
    struct Wrapped(#[source] kube::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("outer: {0}")]
    struct Outer(#[source] Inner);
    #[derive(Debug, thiserror::Error)]
    #[error("inner\nproblem")]
    struct Inner(#[source] std::io::Error);

    #[test]
    fn api_errors_read_as_message_code_and_reason_once() {
        let line = one_line(&Wrapped(forbidden()));
        assert_eq!(
            line,
            "Harvester API: reading VM vm1: virtualmachines.kubevirt.io \"vm1\" is forbidden: User \"x\" cannot get resource (HTTP 403 Forbidden)"
        );
        assert!(!line.contains("Status {"), "{line}");
    }

    #[test]
    fn status_predicates_read_the_code() {
        assert!(is_forbidden(&forbidden()));
        assert!(!is_not_found(&forbidden()) && !is_conflict(&forbidden()));
        assert!(!has_code(
            &kube::Error::LinesCodecMaxLineLengthExceeded,
            403
        ));
    }

    #[test]
    fn other_errors_keep_their_causes_once() {
        let e = Outer(Inner(std::io::Error::other("disk on fire")));
        assert_eq!(one_line(&e), "outer: inner problem: disk on fire");
    }
}
