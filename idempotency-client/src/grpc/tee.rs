//! A request body sent as it comes and copied on the way, so the request
//! can be sent again: gRPC's own retry design buffers this way, and gives
//! up retrying once the copy would grow past a limit. A unary call's
//! message is copied whole; a stream longer than the limit is sent once.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::Status;
use tonic::body::Body;

/// The largest body copied: gRPC's default largest message.
pub(super) const COPY_LIMIT: usize = 4 * 1024 * 1024;

/// What was copied of a body so far.
#[derive(Default)]
pub(super) struct Copy {
    bytes: BytesMut,
    state: State,
}

#[derive(Default, PartialEq, Eq)]
enum State {
    #[default]
    Copying,
    /// The whole body, ended.
    Whole,
    /// Past the limit, with trailers, or failed: it cannot be sent again.
    Lost,
}

impl Copy {
    /// The whole body again, once it was sent to its end.
    pub(super) fn again(&self) -> Option<Body> {
        (self.state == State::Whole).then(|| Body::new(http_body_util::Full::new(self.bytes.clone().freeze())))
    }

    fn ended(&mut self) {
        if self.state == State::Copying {
            self.state = State::Whole;
        }
    }
}

pub(super) type Shared = Arc<Mutex<Copy>>;

pub(super) fn lock(copy: &Shared) -> std::sync::MutexGuard<'_, Copy> {
    copy.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The body as sent the first time, copying into `copy`.
pub(super) struct Tee {
    inner: Body,
    copy: Shared,
}

impl Tee {
    pub(super) fn new(inner: Body, copy: Shared) -> Self {
        if inner.is_end_stream() {
            lock(&copy).ended();
        }
        Tee { inner, copy }
    }
}

impl HttpBody for Tee {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let polled = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        let mut copy = lock(&self.copy);
        match &polled {
            Some(Ok(frame)) => match frame.data_ref() {
                Some(data) if copy.state == State::Copying && copy.bytes.len() + data.len() <= COPY_LIMIT => {
                    copy.bytes.extend_from_slice(data);
                }
                _ => copy.state = State::Lost,
            },
            Some(Err(_)) => copy.state = State::Lost,
            None => copy.ended(),
        }
        if polled.is_some() && self.inner.is_end_stream() {
            copy.ended();
        }
        drop(copy);
        Poll::Ready(polled)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    async fn send(body: Body) -> (Bytes, Shared) {
        let copy = Shared::default();
        let sent = Tee::new(body, copy.clone()).collect().await.expect("a body").to_bytes();
        (sent, copy)
    }

    #[tokio::test]
    async fn a_whole_body_can_be_sent_again() {
        let (sent, copy) = send(Body::new(http_body_util::Full::new(Bytes::from_static(b"\0\0\0\0\x02hi")))).await;
        let again = lock(&copy).again().expect("copied whole");
        let again = again.collect().await.unwrap().to_bytes();
        assert_eq!((sent.as_ref(), again.as_ref()), (&b"\0\0\0\0\x02hi"[..], &b"\0\0\0\0\x02hi"[..]));
        let (_, copy) = send(Body::empty()).await;
        let empty = lock(&copy).again();
        assert!(empty.is_some(), "an empty body too");
    }

    #[tokio::test]
    async fn a_body_past_the_limit_is_sent_once() {
        let big = Bytes::from(vec![7u8; COPY_LIMIT + 1]);
        let (sent, copy) = send(Body::new(http_body_util::Full::new(big))).await;
        assert_eq!(sent.len(), COPY_LIMIT + 1, "sent whole all the same");
        assert!(lock(&copy).again().is_none());
    }

    #[tokio::test]
    async fn a_body_not_sent_to_its_end_cannot_be_sent_again() {
        let copy = Shared::default();
        let mut tee = Tee::new(Body::new(Endless(Some(Bytes::from_static(b"part")))), copy.clone());
        let first = tee.frame().await.expect("a frame").expect("data");
        assert_eq!(first.into_data().unwrap(), "part");
        assert!(lock(&copy).again().is_none(), "the stream goes on");
    }

    /// A stream of one frame that never ends (a client stream still open).
    struct Endless(Option<Bytes>);

    impl HttpBody for Endless {
        type Data = Bytes;
        type Error = Status;

        fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
            match self.0.take() {
                Some(data) => Poll::Ready(Some(Ok(Frame::data(data)))),
                None => Poll::Pending,
            }
        }
    }
}
