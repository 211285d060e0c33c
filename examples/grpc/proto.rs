//! The `idem.example.Payments` service of `payments.proto`, written out by
//! hand in the shape tonic-build generates (messages, the service trait, a
//! server and a client), so that the example and `tests/grpc.rs` build
//! without `protoc`. With tonic-build, this file is `tonic::include_proto!`.

use std::convert::Infallible;

use tonic::codegen::{BoxFuture, Context, Poll, Service, StdError, http};
use tonic::server::{Grpc, NamedService, UnaryService};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

/// `message PayRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PayRequest {
    #[prost(int64, tag = "1")]
    pub order_id: i64,
    /// Integer cents.
    #[prost(int64, tag = "2")]
    pub amount: i64,
}

/// `message PayReply`. Serializable too, so that `#[idempotent]` can record
/// and replay it (tonic-build: `.type_attribute(".", "#[derive(serde::Serialize, serde::Deserialize)]")`).
#[derive(Clone, PartialEq, prost::Message, serde::Serialize, serde::Deserialize)]
pub struct PayReply {
    #[prost(int64, tag = "1")]
    pub order_id: i64,
    #[prost(string, tag = "2")]
    pub user: String,
    #[prost(int64, tag = "3")]
    pub amount: i64,
    #[prost(int64, tag = "4")]
    pub payment_id: i64,
}

const PAY: &str = "/idem.example.Payments/Pay";

/// `service Payments`, as a service implements it.
#[tonic::async_trait]
pub trait Payments: Send + Sync + 'static {
    /// `rpc Pay(PayRequest) returns (PayReply)`.
    async fn pay(&self, request: Request<PayRequest>) -> Result<Response<PayReply>, Status>;
}

/// Serves a [`Payments`] implementation (`Server::builder().add_service(..)`).
pub struct PaymentsServer<T> {
    inner: std::sync::Arc<T>,
}

impl<T> PaymentsServer<T> {
    pub fn new(inner: T) -> Self {
        PaymentsServer { inner: std::sync::Arc::new(inner) }
    }
}

impl<T> Clone for PaymentsServer<T> {
    fn clone(&self) -> Self {
        PaymentsServer { inner: std::sync::Arc::clone(&self.inner) }
    }
}

impl<T> NamedService for PaymentsServer<T> {
    const NAME: &'static str = "idem.example.Payments";
}

impl<T: Payments, B> Service<http::Request<B>> for PaymentsServer<T>
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let inner = std::sync::Arc::clone(&self.inner);
        match request.uri().path() {
            PAY => Box::pin(async move { Ok(Grpc::new(ProstCodec::default()).unary(Pay(inner), request).await) }),
            _ => Box::pin(async { Ok(Status::unimplemented("no such method").into_http()) }),
        }
    }
}

/// The `Pay` method as tonic's server calls it.
struct Pay<T>(std::sync::Arc<T>);

impl<T: Payments> UnaryService<PayRequest> for Pay<T> {
    type Response = PayReply;
    type Future = BoxFuture<Response<PayReply>, Status>;

    fn call(&mut self, request: Request<PayRequest>) -> Self::Future {
        let inner = std::sync::Arc::clone(&self.0);
        Box::pin(async move { inner.pay(request).await })
    }
}

/// Calls `Payments` over a channel, or over any service tonic clients call
/// (a `Channel` wrapped in tower layers, say), as tonic-build's clients do.
#[derive(Clone)]
pub struct PaymentsClient<T = tonic::transport::Channel> {
    inner: tonic::client::Grpc<T>,
}

impl<T> PaymentsClient<T>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<StdError> + Send,
{
    pub fn new(inner: T) -> Self {
        PaymentsClient { inner: tonic::client::Grpc::new(inner) }
    }

    /// `rpc Pay`; metadata goes on the request (`request.metadata_mut()`).
    pub async fn pay(&mut self, request: impl tonic::IntoRequest<PayRequest>) -> Result<Response<PayReply>, Status> {
        self.inner.ready().await.map_err(|e| Status::unknown(format!("the channel is not ready: {}", e.into())))?;
        let path = http::uri::PathAndQuery::from_static(PAY);
        self.inner.unary(request.into_request(), path, ProstCodec::default()).await
    }
}
