//! The kubelet's gRPC requests on a unix socket, made acceptable to the HTTP/2 server.
//!
//! The kubelet dials a plugin's registration socket with `grpc.DialContext(path)` and a unix
//! dialer (`pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go`, Kubernetes
//! 1.34 to 1.37, grpc-go 1.72 to 1.82). grpc-go then sends the percent-encoded socket path as the request's
//! `:authority` (`%2Fvar%2Flib%2Fkubelet%2F...`). That is no valid authority (RFC 9113 §8.3.1
//! asks for `host[:port]`), and the HTTP/2 server under tonic (`h2`) refuses the stream with
//! `PROTOCOL_ERROR` ("malformed authority"), so the kubelet could never register the plugin.
//! Asked of each kubelet on the real node (`real_node::dra_gate_guards_pods_by_the_layer_the_nodes_kubelet_supports`,
//! 1.34.4, 1.35.4, 1.36.3, 1.37.2): a registration socket served without the rewrite fails
//! `GetInfo` with `stream terminated by RST_STREAM with error code: PROTOCOL_ERROR`, the same
//! socket through it is called. Only the registration socket has it: the kubelet dials the DRA
//! socket by a `unix:` target (`grpc.NewClient`), for which grpc-go sends `localhost`.
//!
//! [`AuthorityRewrite`] sits between the socket and the server and rewrites, in each complete
//! `HEADERS` frame the client sends, the value of every literal `:authority` field (static name
//! index 1) to `localhost`, which is what grpc-go itself sends over unix sockets it dials by
//! `unix:` target. Nothing else of the stream changes, and the server never reads the
//! authority.
//!
//! HPACK: only the boundaries of the header block's representations are parsed (RFC 7541 §6:
//! integers and string lengths); no value is decoded. A rewritten literal with incremental
//! indexing enters the server's dynamic table as `localhost`, so a later request's indexed
//! reference to it also reads `localhost`. The server's table then holds fewer bytes than the
//! client's; the two could only disagree after an eviction, which a registration (two calls on a
//! connection of its own) never comes near. A block split into `CONTINUATION` frames, or one
//! that does not parse, is passed on unchanged.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
const AUTHORITY: &[u8] = b"localhost";

/// A server-side stream whose incoming HTTP/2 `HEADERS` carry `:authority: localhost`.
pub struct AuthorityRewrite<S> {
    inner: S,
    /// Bytes read but not yet a complete preface or frame.
    pending: Vec<u8>,
    /// Bytes ready for the server.
    ready: Vec<u8>,
    /// How much of `ready` the server has read.
    offset: usize,
    preface_done: bool,
    eof: bool,
}

impl<S> AuthorityRewrite<S> {
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            pending: Vec::new(),
            ready: Vec::new(),
            offset: 0,
            preface_done: false,
            eof: false,
        }
    }

    /// Moves every complete unit of `pending` to `ready`.
    fn process(&mut self) {
        if !self.preface_done {
            let n = PREFACE.len().min(self.pending.len());
            if self.pending[..n] != PREFACE[..n] {
                // Not HTTP/2 with prior knowledge: pass everything through as it is.
                self.preface_done = true;
                self.passthrough_all();
                return;
            }
            if self.pending.len() < PREFACE.len() {
                return;
            }
            self.ready.extend(self.pending.drain(..PREFACE.len()));
            self.preface_done = true;
        }
        loop {
            if self.pending.len() < 9 {
                return;
            }
            let len = (usize::from(self.pending[0]) << 16)
                | (usize::from(self.pending[1]) << 8)
                | usize::from(self.pending[2]);
            if self.pending.len() < 9 + len {
                return;
            }
            let frame: Vec<u8> = self.pending.drain(..9 + len).collect();
            match rewrite_frame(&frame) {
                Some(rewritten) => self.ready.extend_from_slice(&rewritten),
                None => self.ready.extend_from_slice(&frame),
            }
        }
    }

    fn passthrough_all(&mut self) {
        self.ready.append(&mut self.pending);
    }
}

/// A complete frame (header and payload) with its `:authority` values rewritten; `None` when
/// it is not a complete `HEADERS` frame with a literal `:authority`, or does not parse.
fn rewrite_frame(frame: &[u8]) -> Option<Vec<u8>> {
    let (kind, flags) = (frame[3], frame[4]);
    if kind != HEADERS || flags & END_HEADERS == 0 {
        return None;
    }
    let payload = &frame[9..];
    let mut start = 0;
    let mut pad = 0;
    if flags & PADDED != 0 {
        pad = usize::from(*payload.first()?);
        start = 1;
    }
    if flags & PRIORITY != 0 {
        start += 5;
    }
    let end = payload.len().checked_sub(pad)?;
    let block = payload.get(start..end)?;
    let rewritten = rewrite_block(block)?;
    let mut out_payload = payload[..start].to_vec();
    out_payload.extend_from_slice(&rewritten);
    out_payload.extend_from_slice(&payload[end..]);
    let len = out_payload.len();
    if len >= 1 << 24 {
        return None;
    }
    let mut out = Vec::with_capacity(9 + len);
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8]);
    out.extend_from_slice(&frame[3..9]);
    out.extend_from_slice(&out_payload);
    Some(out)
}

/// An HPACK integer with an `n`-bit prefix at `b[i]` (RFC 7541 §5.1): its value and the index
/// after it.
fn integer(b: &[u8], i: usize, n: u32) -> Option<(usize, usize)> {
    let mask = (1usize << n) - 1;
    let mut value = usize::from(*b.get(i)?) & mask;
    let mut i = i + 1;
    if value < mask {
        return Some((value, i));
    }
    let mut shift = 0u32;
    loop {
        let byte = *b.get(i)?;
        i += 1;
        value = value.checked_add(usize::from(byte & 0x7f).checked_shl(shift)?)?;
        shift += 7;
        if byte & 0x80 == 0 {
            return Some((value, i));
        }
        if shift > 28 {
            return None;
        }
    }
}

/// The index after an HPACK string literal at `b[i]` (RFC 7541 §5.2).
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    let (len, after) = integer(b, i, 7)?;
    let end = after.checked_add(len)?;
    (end <= b.len()).then_some(end)
}

/// The header block with every literal `:authority` value replaced by `localhost`; `None` when
/// it has none or does not parse.
fn rewrite_block(b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let mut changed = false;
    while i < b.len() {
        let first = b[i];
        let start = i;
        let (index, mut next) = if first & 0x80 != 0 {
            // Indexed field.
            let (_, next) = integer(b, i, 7)?;
            out.extend_from_slice(&b[start..next]);
            i = next;
            continue;
        } else if first & 0x40 != 0 {
            // Literal with incremental indexing.
            integer(b, i, 6)?
        } else if first & 0x20 != 0 {
            // Dynamic table size update.
            let (_, next) = integer(b, i, 5)?;
            out.extend_from_slice(&b[start..next]);
            i = next;
            continue;
        } else {
            // Literal without indexing, or never indexed.
            integer(b, i, 4)?
        };
        if index == 0 {
            next = string_end(b, next)?;
        }
        let value_end = string_end(b, next)?;
        if index == 1 {
            // The representation and its name index as they were, then the new value.
            out.extend_from_slice(&b[start..next]);
            out.push(AUTHORITY.len() as u8);
            out.extend_from_slice(AUTHORITY);
            changed = true;
        } else {
            out.extend_from_slice(&b[start..value_end]);
        }
        i = value_end;
    }
    changed.then_some(out)
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityRewrite<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.offset < this.ready.len() {
                let n = (this.ready.len() - this.offset).min(buf.remaining());
                buf.put_slice(&this.ready[this.offset..this.offset + n]);
                this.offset += n;
                if this.offset == this.ready.len() {
                    this.ready.clear();
                    this.offset = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 8192];
            let mut read = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    let got = read.filled();
                    if got.is_empty() {
                        // The client closed: what is left goes as it is.
                        this.eof = true;
                        this.passthrough_all();
                    } else {
                        this.pending.extend_from_slice(got);
                        this.process();
                    }
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityRewrite<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for AuthorityRewrite<tokio::net::UnixStream> {
    type ConnectInfo = <tokio::net::UnixStream as tonic::transport::server::Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header block as grpc-go writes a request's: `:method POST` (static 3), `:scheme http`
    /// (static 6), `:path` (literal, incremental indexing, name 4), `:authority` (literal,
    /// incremental indexing, name 1), `content-type` (literal, new name), and `te` never
    /// indexed.
    fn block(authority: &[u8]) -> Vec<u8> {
        let mut b = vec![0x83, 0x86];
        let path = b"/pluginregistration.Registration/GetInfo";
        b.push(0x44);
        b.push(path.len() as u8);
        b.extend_from_slice(path);
        b.push(0x41);
        // A long value: the 7-bit length prefix continues.
        assert!(authority.len() >= 127);
        b.push(0x7f);
        b.push((authority.len() - 127) as u8);
        b.extend_from_slice(authority);
        b.push(0x40);
        b.push(12);
        b.extend_from_slice(b"content-type");
        b.push(16);
        b.extend_from_slice(b"application/grpc");
        b.push(0x10);
        b.push(2);
        b.extend_from_slice(b"te");
        b.push(8);
        b.extend_from_slice(b"trailers");
        b
    }

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
            kind,
            flags,
            0,
            0,
            0,
            1,
        ];
        f.extend_from_slice(payload);
        f
    }

    fn long_path() -> Vec<u8> {
        b"%2Ftmp%2Fmeshgate-node-abcdef%2Fkubelet%2Froot%2Fplugins_registry%2Fgate.meshgate.dev-reg.sock%2Fand-some-more-to-pass-127-bytes"
            .to_vec()
    }

    #[test]
    fn the_authority_literal_becomes_localhost_and_nothing_else_changes() {
        let original = block(&long_path());
        let out = rewrite_block(&original).expect("rewritten");
        let mut want = block(&long_path());
        let at = want.iter().position(|b| *b == 0x41).expect("authority");
        let value_end = at + 3 + long_path().len();
        want.splice(at + 1..value_end, [9u8].into_iter().chain(*b"localhost"));
        assert_eq!(out, want);
        // A block without a literal authority (a later request indexes it) is not touched.
        assert_eq!(rewrite_block(&[0x83, 0x86, 0xbe]), None);
        // Truncated: left alone.
        assert_eq!(rewrite_block(&original[..original.len() - 3]), None);
    }

    #[test]
    fn frames_are_rewritten_with_their_length_padding_and_priority() {
        let b = block(&long_path());
        let plain = rewrite_frame(&frame(HEADERS, END_HEADERS, &b)).expect("plain");
        let rewritten = rewrite_block(&b).expect("block");
        assert_eq!(plain[9..], rewritten[..]);
        let len =
            (usize::from(plain[0]) << 16) | (usize::from(plain[1]) << 8) | usize::from(plain[2]);
        assert_eq!(len, rewritten.len());

        let mut padded = vec![3u8, 0, 0, 0, 7, 16];
        padded.extend_from_slice(&b);
        padded.extend_from_slice(&[0, 0, 0]);
        let out = rewrite_frame(&frame(HEADERS, END_HEADERS | PADDED | PRIORITY, &padded))
            .expect("padded");
        assert_eq!(out[9..15], [3u8, 0, 0, 0, 7, 16]);
        assert_eq!(out[15..out.len() - 3], rewritten[..]);
        assert_eq!(out[out.len() - 3..], [0, 0, 0]);

        // DATA frames, and a block continued in CONTINUATION frames, pass unchanged.
        assert_eq!(rewrite_frame(&frame(0x0, 0x1, &b)), None);
        assert_eq!(rewrite_frame(&frame(HEADERS, 0, &b)), None);
    }

    #[tokio::test]
    async fn a_stream_split_anywhere_reads_as_the_rewritten_stream() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let b = block(&long_path());
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, &[]));
        input.extend(frame(HEADERS, END_HEADERS, &b));
        input.extend(frame(0x0, 0x1, b"\x00\x00\x00\x00\x00"));
        let mut want = PREFACE.to_vec();
        want.extend(frame(0x4, 0, &[]));
        want.extend(rewrite_frame(&frame(HEADERS, END_HEADERS, &b)).expect("headers"));
        want.extend(frame(0x0, 0x1, b"\x00\x00\x00\x00\x00"));
        for split in [1, 7, 9, 24, 30, 64] {
            let (mut client, server) = tokio::io::duplex(16);
            let data = input.clone();
            let writer = tokio::spawn(async move {
                for chunk in data.chunks(split) {
                    client.write_all(chunk).await.expect("write");
                }
            });
            let mut got = Vec::new();
            AuthorityRewrite::new(server)
                .read_to_end(&mut got)
                .await
                .expect("read");
            writer.await.expect("writer");
            assert_eq!(got, want, "split every {split} bytes");
        }
    }
}
