//! The request-body limit (`extract::MAX_BODY_BYTES`), refused so that the client
//! reads the refusal.
//!
//! HTTP/1.1 cannot refuse the rest of a body but by closing the connection, and a
//! socket closed with unread bytes in it makes the kernel send a reset: a client
//! still writing its body then gets a broken pipe or a reset instead of the 413,
//! and may discard the answer it had already received. So a body past the limit is
//! read to its end and thrown away (up to `MAX_DRAINED_BODY_BYTES`) before the 413
//! is answered, whether its length was declared (answered here, before any route
//! runs) or it came chunked (the route's read fails once the drain is over). A
//! request that asked `Expect: 100-continue` is refused at once instead: it has not
//! sent its body and is told not to.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::http::header::{CONTENT_LENGTH, EXPECT};
use axum::response::{IntoResponse, Response};

use crate::extract::{payload_too_large, BodyTooLarge, MAX_BODY_BYTES};

/// The most of a refused body read (and discarded) before its 413, counted from
/// its first byte. A client that sent a batch somewhat past the limit reads why it
/// was refused; past this the connection is closed unread, since reading more only
/// spends bandwidth on bytes that are thrown away (the request's deadline bounds
/// how long the reading may take).
pub const MAX_DRAINED_BODY_BYTES: u64 = 8 * 1024 * 1024;

/// The body-limit layer (a tower layer rather than a `from_fn` middleware: it
/// wraps the whole router, and `from_fn` boxes what it wraps on every request).
#[derive(Clone, Copy, Debug, Default)]
pub struct BodyLimitLayer;

impl<S> tower::Layer<S> for BodyLimitLayer {
    type Service = BodyLimit<S>;

    fn layer(&self, inner: S) -> BodyLimit<S> {
        BodyLimit { inner }
    }
}

/// A declared length past the limit is answered 413 (after the body is drained);
/// any other body reaches the service limited to `MAX_BODY_BYTES`, drained when
/// it passes it.
#[derive(Clone, Debug)]
pub struct BodyLimit<S> {
    inner: S,
}

impl<S> tower::Service<Request> for BodyLimit<S>
where
    S: tower::Service<Request, Response = Response>,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = futures::future::Either<
        S::Future,
        futures::future::BoxFuture<'static, Result<Response, S::Error>>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let declared = request
            .headers()
            .get(CONTENT_LENGTH)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.trim().parse::<u64>().ok());
        if declared.is_none_or(|length| length <= MAX_BODY_BYTES as u64) {
            // A request without a body (most reads) has nothing to limit.
            let request = if request.body().is_end_stream() {
                request
            } else {
                request.map(|body| Body::new(DrainingLimit::new(body)))
            };
            return futures::future::Either::Left(self.inner.call(request));
        }
        let expects_continue = request
            .headers()
            .get(EXPECT)
            .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        let drains =
            !expects_continue && declared.is_some_and(|length| length <= MAX_DRAINED_BODY_BYTES);
        futures::future::Either::Right(Box::pin(async move {
            if drains {
                drain(request.into_body()).await;
            }
            Ok(payload_too_large().into_response())
        }))
    }
}

/// Reads and discards a body up to `MAX_DRAINED_BODY_BYTES`, stopping early if it
/// breaks off or stops arriving (the body-read timeout around every request).
async fn drain(body: Body) {
    let mut body = DrainingLimit {
        inner: body,
        read: 0,
        state: State::Draining,
    };
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        if frame.is_err() {
            break;
        }
    }
}

/// Where a `DrainingLimit` is in its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Within the limit: frames pass through.
    Passing,
    /// Past it: frames are read and thrown away.
    Draining,
    /// The refusal was reported; nothing follows.
    Refused,
}

/// A body limited to `MAX_BODY_BYTES` that, once past it, reads the rest (up to
/// `MAX_DRAINED_BODY_BYTES`) before it reports `BodyTooLarge`.
struct DrainingLimit {
    inner: Body,
    /// Data bytes read so far, passed through or drained.
    read: u64,
    state: State,
}

impl DrainingLimit {
    fn new(inner: Body) -> Self {
        Self {
            inner,
            read: 0,
            state: State::Passing,
        }
    }
}

impl HttpBody for DrainingLimit {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        loop {
            if this.state == State::Refused {
                return Poll::Ready(None);
            }
            let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
            let frame = match frame {
                Some(Ok(frame)) => frame,
                Some(Err(error)) if this.state == State::Passing => {
                    return Poll::Ready(Some(Err(error.into())))
                }
                // A drained body that breaks off or ends: the refusal is what the
                // route hears about.
                Some(Err(_)) | None if this.state == State::Draining => {
                    this.state = State::Refused;
                    return Poll::Ready(Some(Err(Box::new(BodyTooLarge))));
                }
                _ => return Poll::Ready(None),
            };
            let length = frame.data_ref().map_or(0, |data| data.len() as u64);
            this.read = this.read.saturating_add(length);
            match this.state {
                State::Passing if this.read <= MAX_BODY_BYTES as u64 => {
                    return Poll::Ready(Some(Ok(frame)))
                }
                State::Passing | State::Draining if this.read <= MAX_DRAINED_BODY_BYTES => {
                    this.state = State::Draining;
                }
                _ => {
                    this.state = State::Refused;
                    return Poll::Ready(Some(Err(Box::new(BodyTooLarge))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.state == State::Refused || (self.state == State::Passing && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self.state {
            State::Passing => self.inner.size_hint(),
            _ => hyper::body::SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn chunked(sizes: &[usize]) -> Body {
        let frames: Vec<Result<Bytes, std::io::Error>> = sizes
            .iter()
            .map(|size| Ok(Bytes::from(vec![b'x'; *size])))
            .collect();
        Body::from_stream(futures::stream::iter(frames))
    }

    /// How many bytes the inner body gave up, whatever the limited body answered.
    async fn read_through(sizes: Vec<usize>) -> (Result<usize, String>, usize) {
        let counted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = counted.clone();
        let frames = sizes.into_iter().map(move |size| {
            seen.fetch_add(size, std::sync::atomic::Ordering::SeqCst);
            Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; size]))
        });
        let inner = Body::from_stream(futures::stream::iter(frames));
        let answer = DrainingLimit::new(inner)
            .collect()
            .await
            .map(|collected| collected.to_bytes().len())
            .map_err(|error| error.to_string());
        (answer, counted.load(std::sync::atomic::Ordering::SeqCst))
    }

    #[tokio::test]
    async fn a_body_within_the_limit_passes_whole() {
        let size = MAX_BODY_BYTES / 4;
        let (answer, read) = read_through(vec![size, size, size, size]).await;
        assert_eq!(answer, Ok(MAX_BODY_BYTES));
        assert_eq!(read, MAX_BODY_BYTES);
    }

    #[tokio::test]
    async fn a_body_past_the_limit_is_read_to_its_end_then_refused() {
        let chunk = 64 * 1024;
        let chunks = vec![chunk; 3 * MAX_BODY_BYTES / chunk];
        let (answer, read) = read_through(chunks).await;
        let error = answer.expect_err("refused");
        assert!(error.contains("limited to"), "{error}");
        assert_eq!(read, 3 * MAX_BODY_BYTES, "drained to its end");
    }

    #[tokio::test]
    async fn draining_stops_at_its_own_bound() {
        let chunk = 1024 * 1024;
        let chunks = vec![chunk; 2 * MAX_DRAINED_BODY_BYTES as usize / chunk];
        let (answer, read) = read_through(chunks).await;
        assert!(answer.is_err());
        assert!(
            read as u64 <= MAX_DRAINED_BODY_BYTES + chunk as u64,
            "read {read} bytes of a body twice the drain bound"
        );
        assert!(read as u64 > MAX_DRAINED_BODY_BYTES, "read {read}");
    }

    #[tokio::test]
    async fn the_refusal_is_reported_once_then_the_body_ends() {
        let mut body = DrainingLimit::new(chunked(&[MAX_BODY_BYTES + 1, 10]));
        assert!(body.frame().await.expect("a frame").is_err());
        assert!(body.frame().await.is_none());
        assert!(body.is_end_stream());
    }
}
