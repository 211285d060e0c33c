//! A request body kept so the call can be sent again. What the body has
//! ready at once is read before the first attempt: a unary call's whole
//! message, which every attempt then sends from the copy, even when the
//! first never got its connection. A stream still open goes out as it
//! comes, copied on the way; gRPC's own retry design buffers this way, and
//! gives up retrying once the copy would pass a limit.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker, ready};

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
    /// The whole body again, once it was read to its end.
    pub(super) fn again(&self) -> Option<Body> {
        (self.state == State::Whole).then(|| Body::new(http_body_util::Full::new(self.bytes.clone().freeze())))
    }

    fn ended(&mut self) {
        if self.state == State::Copying {
            self.state = State::Whole;
        }
    }

    fn record(&mut self, frame: &Result<Frame<Bytes>, Status>) {
        match frame.as_ref().map(Frame::data_ref) {
            Ok(Some(data)) if self.state == State::Copying && self.bytes.len() + data.len() <= COPY_LIMIT => {
                self.bytes.extend_from_slice(data);
            }
            _ => self.state = State::Lost,
        }
    }
}

pub(super) type Shared = Arc<Mutex<Copy>>;

pub(super) fn lock(copy: &Shared) -> std::sync::MutexGuard<'_, Copy> {
    copy.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Reads what `body` has ready into `copy` and returns what the first
/// attempt sends: the copy itself when the body ended, else what was read
/// followed by the rest, copied on the way.
pub(super) fn prepare(body: Body, copy: &Shared) -> Body {
    let mut tee = Tee { read: VecDeque::new(), inner: body, copy: Arc::clone(copy) };
    let mut cx = Context::from_waker(Waker::noop());
    {
        let mut copy = lock(copy);
        while copy.state == State::Copying {
            if tee.inner.is_end_stream() {
                copy.ended();
                break;
            }
            match Pin::new(&mut tee.inner).poll_frame(&mut cx) {
                Poll::Ready(Some(frame)) => {
                    copy.record(&frame);
                    tee.read.push_back(frame);
                }
                Poll::Ready(None) => copy.ended(),
                // A stream the caller goes on writing: sent as it comes.
                Poll::Pending => break,
            }
        }
        if let Some(whole) = copy.again() {
            return whole;
        }
    }
    Body::new(tee)
}

/// The body as sent the first time: what was read already, then the rest,
/// copied into `copy`.
struct Tee {
    read: VecDeque<Result<Frame<Bytes>, Status>>,
    inner: Body,
    copy: Shared,
}

impl HttpBody for Tee {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(frame) = self.read.pop_front() {
            return Poll::Ready(Some(frame));
        }
        let polled = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        let mut copy = lock(&self.copy);
        match &polled {
            Some(frame) => copy.record(frame),
            None => copy.ended(),
        }
        if polled.is_some() && self.inner.is_end_stream() {
            copy.ended();
        }
        drop(copy);
        Poll::Ready(polled)
    }

    fn is_end_stream(&self) -> bool {
        self.read.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    async fn bytes(body: Body) -> Bytes {
        body.collect().await.expect("a body").to_bytes()
    }

    #[tokio::test]
    async fn a_body_ready_whole_is_copied_before_the_first_attempt() {
        let message = Bytes::from_static(b"\0\0\0\0\x02hi");
        let copy = Shared::default();
        let first = prepare(Body::new(http_body_util::Full::new(message.clone())), &copy);
        let again = lock(&copy).again().expect("copied whole before any attempt");
        assert_eq!((bytes(first).await, bytes(again).await), (message.clone(), message));
        let copy = Shared::default();
        let _ = prepare(Body::empty(), &copy);
        let empty = lock(&copy).again();
        assert!(empty.is_some(), "an empty body too");
    }

    #[tokio::test]
    async fn a_body_past_the_limit_is_sent_once() {
        let big = Bytes::from(vec![7u8; COPY_LIMIT + 1]);
        let copy = Shared::default();
        let sent = bytes(prepare(Body::new(http_body_util::Full::new(big)), &copy)).await;
        assert_eq!(sent.len(), COPY_LIMIT + 1, "sent whole all the same");
        let again = lock(&copy).again();
        assert!(again.is_none());
    }

    #[tokio::test]
    async fn a_stream_still_open_is_sent_as_it_comes_and_cannot_be_sent_again() {
        let copy = Shared::default();
        let mut first = prepare(Body::new(Endless(Some(Bytes::from_static(b"part")))), &copy);
        let frame = first.frame().await.expect("a frame").expect("data");
        assert_eq!(frame.into_data().unwrap(), "part");
        let again = lock(&copy).again();
        assert!(again.is_none(), "the stream goes on");
    }

    /// A stream that has one frame ready, then waits (a client stream
    /// still open): polled once more, it is pending for ever.
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
