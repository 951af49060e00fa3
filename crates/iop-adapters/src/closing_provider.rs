//! A test provider that ends its kept-alive connections in each of the ways real servers
//! do (for the plain pool's and the reqwest paths' tests): it answers every request on a
//! connection with a small chunked event stream, counting connections.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

pub const BODY: &str = "data: one\n\ndata: two\n\n";

/// How the test provider ends its connections.
#[derive(Clone, Copy)]
pub enum Closing {
    /// Keeps every connection open.
    Never,
    /// Closes after the first response without saying so (as an idle timeout would).
    Silently,
    /// Says `connection: close` in the first response and closes after it.
    Announced,
    /// Keeps a connection after its first response, and closes it, unanswered, when
    /// a second request arrives on it (its idle timeout crossing that request).
    UnderTheNextRequest,
}

/// A provider that answers every request on a connection with a chunked event stream,
/// counting connections.
pub async fn provider(closing: Closing) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut served = 0;
                loop {
                    let mut chunk = [0u8; 4096];
                    let n = match socket.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    buf.extend_from_slice(&chunk[..n]);
                    // Requests carry a 2-byte body after the head.
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        if buf.len() < end + 4 + 2 {
                            break;
                        }
                        buf.drain(..end + 4 + 2);
                        served += 1;
                        if served == 2 && matches!(closing, Closing::UnderTheNextRequest) {
                            return;
                        }
                        let close = match closing {
                            Closing::Announced => "connection: close\r\n",
                            _ => "",
                        };
                        let mut response = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n{close}transfer-encoding: chunked\r\n\r\n",
                        );
                        for event in ["data: one\n\n", "data: two\n\n"] {
                            response.push_str(&format!("{:x}\r\n{event}\r\n", event.len()));
                        }
                        response.push_str("0\r\n\r\n");
                        socket.write_all(response.as_bytes()).await.unwrap();
                        if matches!(closing, Closing::Silently | Closing::Announced) {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, accepted)
}
