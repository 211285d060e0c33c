//! A problem of the application's own under its own `type` URI: a
//! [`ProblemDetails`] the application builds is otherwise typed in the
//! crate's namespace (`urn:idem:problem:<code>`), like the engine's.

use std::borrow::Cow;
use std::fmt;

use super::framework::HttpStatus;
use super::problem::ProblemDetails;

/// A [`ProblemDetails`] answered with a `type` the application names
/// ([`ProblemDetails::with_type`]), e.g.
/// `https://shop.example/problems/payment-declined`: the same status,
/// `application/problem+json` body (`type`, `title`, `status`, `code`,
/// `detail`), `Retry-After` and `Idempotency-Should-Retry`. An `IntoResponse` (axum) and a
/// `ResponseError` and `Responder` (actix-web), as a problem is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypedProblem<S = u16> {
    /// The problem: status, code, title, detail, `Retry-After`.
    pub problem: ProblemDetails<S>,
    /// Its `type`: a URI in the application's namespace (RFC 9457 asks for
    /// one a person can dereference to the problem's documentation, or a
    /// URN), sent as given.
    pub type_uri: Cow<'static, str>,
}

impl<S: HttpStatus> ProblemDetails<S> {
    /// This problem under the application's own `type` URI, in place of
    /// `urn:idem:problem:<code>`:
    ///
    /// ```
    /// # use idempotency_runtime::http::ProblemDetails;
    /// let declined = ProblemDetails { status: 402, code: "PAYMENT_DECLINED", title: "Payment declined",
    ///     detail: "the amount is over the card's limit".into(), retry_after: None }
    ///     .with_type("https://shop.example/problems/payment-declined");
    /// assert!(declined.body().starts_with(r#"{"type":"https://shop.example/problems/payment-declined","#));
    /// ```
    pub fn with_type(self, type_uri: impl Into<Cow<'static, str>>) -> TypedProblem<S> {
        TypedProblem { problem: self, type_uri: type_uri.into() }
    }
}

impl<S: HttpStatus> TypedProblem<S> {
    /// The JSON body, as sent.
    pub fn body(&self) -> String {
        self.problem.body_of_type(&self.type_uri)
    }
}

impl<S> fmt::Display for TypedProblem<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.problem.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn declined<S: HttpStatus>() -> TypedProblem<S> {
        let problem: ProblemDetails<S> = ProblemDetails {
            retry_after: Some(7),
            ..ProblemDetails::new(402, "PAYMENT_DECLINED", "Payment declined", "over the limit".into())
        };
        problem.with_type("https://shop.example/problems/payment-declined")
    }

    const BODY: &str = r#"{"type":"https://shop.example/problems/payment-declined","title":"Payment declined","status":402,"code":"PAYMENT_DECLINED","detail":"over the limit"}"#;

    /// Regression: an application's problem could only be typed in the
    /// crate's namespace (`urn:idem:problem:payment-declined`).
    #[test]
    fn the_application_names_the_type_and_nothing_else_changes() {
        let typed = declined::<u16>();
        assert_eq!(typed.body(), BODY);
        assert_eq!(typed.problem.body(), BODY.replace("https://shop.example/problems/", "urn:idem:problem:"));
        assert_eq!(typed.to_string(), "PAYMENT_DECLINED: over the limit");
    }

    #[cfg(feature = "axum")]
    #[tokio::test]
    async fn axum_answers_it_as_a_problem() {
        use axum::response::IntoResponse;
        let response = declined::<http::StatusCode>().into_response();
        assert_eq!(response.status(), 402);
        assert_eq!(response.headers()["content-type"], super::super::PROBLEM_JSON);
        assert_eq!(response.headers()["retry-after"], "7");
        assert_eq!(response.headers()["idempotency-should-retry"], "true");
        assert_eq!(axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap(), BODY.as_bytes());
    }

    #[cfg(feature = "actix")]
    #[tokio::test]
    async fn actix_answers_it_as_a_problem() {
        use actix_web::ResponseError;
        let typed = declined::<actix_web::http::StatusCode>();
        assert_eq!(typed.status_code(), actix_web::http::StatusCode::PAYMENT_REQUIRED);
        let response = typed.error_response();
        assert_eq!(response.headers().get("content-type").unwrap(), super::super::PROBLEM_JSON);
        assert_eq!(response.headers().get("retry-after").unwrap(), "7");
        assert_eq!(response.headers().get("idempotency-should-retry").unwrap(), "true");
        assert_eq!(actix_web::body::to_bytes(response.into_body()).await.unwrap(), BODY.as_bytes());
    }
}
