//! Compressing an answer where it was written, off the request workers.
//!
//! The layer around every router (`crate::compression`) compresses an answer as
//! hyper sends it, on the request workers, at request priority. For the ingest
//! answer (a report per event, ~35 KB of JSON for a batch of 100) that was ~50 µs
//! of a request worker's time per batch for a client that accepts gzip, beside the
//! queries those workers serve; ingest's other work already runs at background
//! priority (docs/benchmarks.md, "Ingest answers compressed on the intake runtime",
//! where the rate and the usage p99 stayed level within the VM's noise). So the
//! ingest answer is compressed on the intake runtime, with that same layer: the
//! client's `Accept-Encoding` is negotiated and the body compressed by tower-http
//! exactly as for every other answer, and the layer around the router leaves an
//! answer that already has a `Content-Encoding` alone.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full};
use tower::{Layer, ServiceExt};

use crate::error::ApiError;

/// `body` (of `content_type`) as it is sent to the client whose request carried
/// `request_headers` (the layer reads their `Accept-Encoding`, every one of them):
/// the headers to add to the answer (`Content-Type`, and `Content-Encoding` and
/// `Vary` where it is compressed) and the bytes of the body.
pub(crate) async fn encode(
    request_headers: HeaderMap,
    content_type: &'static str,
    body: Vec<u8>,
) -> Result<(HeaderMap, Bytes), ApiError> {
    let mut request = Request::new(());
    *request.headers_mut() = request_headers;
    let mut body = Some(Bytes::from(body));
    let answer = crate::compression().layer(tower::service_fn(move |_: Request<()>| {
        let mut response = Response::new(Full::new(body.take().unwrap_or_default()));
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        std::future::ready(Ok::<_, Infallible>(response))
    }));
    let response = match answer.oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    let (parts, body) = response.into_parts();
    let bytes = body
        .collect()
        .await
        .map_err(|e| ApiError::internal(format!("compressing an answer: {e}")))?
        .to_bytes();
    Ok((parts.headers, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::header::{CONTENT_ENCODING, VARY};

    fn accept(values: &[&'static str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(
                axum::http::header::ACCEPT_ENCODING,
                HeaderValue::from_static(value),
            );
        }
        headers
    }

    fn large() -> Vec<u8> {
        let len = usize::from(crate::MIN_COMPRESSED_BODY_BYTES) * 4;
        format!("[{}0]", "0,".repeat(len / 2)).into_bytes()
    }

    #[tokio::test]
    async fn negotiates_as_the_router_layer_does() {
        // Accepted: compressed, named, and marked as varying with the header.
        for sent in [
            &["gzip"][..],
            &["br, gzip;q=0.5"],
            &["identity;q=0.1", "GZIP"],
        ] {
            let (headers, bytes) = encode(accept(sent), "application/json", large())
                .await
                .unwrap();
            assert_eq!(headers[CONTENT_ENCODING], "gzip", "{sent:?}");
            assert_eq!(headers[CONTENT_TYPE], "application/json");
            assert_eq!(headers[VARY], "accept-encoding");
            let mut unpacked = Vec::new();
            std::io::Read::read_to_end(
                &mut flate2::read::GzDecoder::new(&bytes[..]),
                &mut unpacked,
            )
            .unwrap();
            assert_eq!(unpacked, large(), "{sent:?}");
            assert!(bytes.len() < large().len());
        }
        // Not accepted, or too small to be worth it: the body as written.
        for (sent, body) in [
            (&[][..], large()),
            (&["gzip;q=0"], large()),
            (&["identity"], large()),
            (&["gzip;q=0.5, identity"], large()),
            (&["gzip"], b"{\"small\":true}".to_vec()),
        ] {
            let (headers, bytes) = encode(accept(sent), "application/json", body.clone())
                .await
                .unwrap();
            assert!(headers.get(CONTENT_ENCODING).is_none(), "{sent:?}");
            assert_eq!(headers[CONTENT_TYPE], "application/json");
            assert_eq!(bytes[..], body[..], "{sent:?}");
        }
    }
}
