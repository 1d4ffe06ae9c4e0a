//! One readable line for a Kubernetes API error. kube's own text repeats the whole `Status`
//! struct (`ApiError: m: R (Status { status: Some(Failure), code: 403, message: "m", ... })`),
//! which is what an operator then reads in every Event and log line. Also the status predicates
//! the controllers branch on ([`is_not_found`], [`is_conflict`], [`is_forbidden`]).

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

/// The API server answered with this HTTP status code. By code, not by reason (kube's
/// `Status::is_conflict` follows client-go and reads the reason first): a create's
/// `AlreadyExists` and an update's `Conflict` are both 409, and every caller treats them alike.
pub fn has_code(err: &kube::Error, code: u16) -> bool {
    matches!(err, kube::Error::Api(s) if s.code == code)
}

/// 404: the object (or its namespace) does not exist.
pub fn is_not_found(err: &kube::Error) -> bool {
    has_code(err, 404)
}

/// 409: the object already exists (create) or changed since it was read (update).
pub fn is_conflict(err: &kube::Error) -> bool {
    has_code(err, 409)
}

/// 403: RBAC (or an admission webhook) refused the request.
pub fn is_forbidden(err: &kube::Error) -> bool {
    has_code(err, 403)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16, reason: &str, message: &str) -> kube::Error {
        let status: kube::core::Status = serde_json::from_value(serde_json::json!({
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code
        }))
        .expect("a Status");
        kube::Error::Api(Box::new(status))
    }

    fn forbidden() -> kube::Error {
        status(
            403,
            "Forbidden",
            "virtualmachines.kubevirt.io \"vm1\" is forbidden: User \"x\" cannot get resource",
        )
    }

    #[test]
    fn predicates_read_the_code() {
        let gone = status(404, "NotFound", "gone");
        let exists = status(409, "AlreadyExists", "there");
        let changed = status(409, "Conflict", "changed");
        assert!(is_not_found(&gone) && !is_conflict(&gone) && !is_forbidden(&gone));
        assert!(is_conflict(&exists) && is_conflict(&changed));
        assert!(is_forbidden(&forbidden()) && !is_not_found(&forbidden()));
        assert!(has_code(&status(422, "Invalid", "bad"), 422));
        let not_api = kube::Error::LinesCodecMaxLineLengthExceeded;
        assert!(!is_not_found(&not_api) && !is_conflict(&not_api) && !is_forbidden(&not_api));
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
