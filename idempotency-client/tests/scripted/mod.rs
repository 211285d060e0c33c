//! An HTTP/1.1 server on a loopback port that answers from a script: each
//! request it reads (head and whole body, `Content-Length` or chunked) is
//! logged, then answered with the script's next step: a response, a
//! connection closed without an answer, or no answer until the test ends.
//! A request past the script is answered 599, which no test expects.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// One step of the script.
#[derive(Clone, Debug)]
pub enum Step {
    /// Answer with this status, these headers and this body.
    Answer(u16, Vec<(&'static str, String)>, &'static str),
    /// Close the connection without a byte of answer (the answer lost).
    Cut,
    /// Read the request, never answer.
    Hang,
}

/// A shorthand for [`Step::Answer`].
pub fn answer(status: u16, headers: &[(&'static str, &str)]) -> Step {
    Step::Answer(status, headers.iter().map(|&(n, v)| (n, v.to_owned())).collect(), "{}")
}

/// A request the server read.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub at: Instant,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn key(&self) -> Option<&str> {
        self.header("idempotency-key")
    }
}

#[derive(Default)]
struct State {
    script: Mutex<VecDeque<Step>>,
    seen: Mutex<Vec<Seen>>,
    /// When each answer was written, in order.
    answered: Mutex<Vec<Instant>>,
}

pub struct Server {
    pub base: String,
    state: Arc<State>,
}

impl Server {
    pub async fn start(script: impl IntoIterator<Item = Step>) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(State { script: Mutex::new(script.into_iter().collect()), ..State::default() });
        let serving = Arc::clone(&state);
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                tokio::spawn(connection(stream, Arc::clone(&serving)));
            }
        });
        Server { base, state }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Every request read so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().unwrap().clone()
    }

    /// When each answer was written.
    pub fn answered(&self) -> Vec<Instant> {
        self.state.answered.lock().unwrap().clone()
    }
}

async fn connection(stream: TcpStream, state: Arc<State>) {
    let mut stream = BufReader::new(stream);
    loop {
        let Some(seen) = read_request(&mut stream).await else { return };
        state.seen.lock().unwrap().push(seen);
        let step = state.script.lock().unwrap().pop_front();
        match step.unwrap_or_else(|| answer(599, &[])) {
            Step::Answer(status, headers, body) => {
                let mut head = format!("HTTP/1.1 {status} Scripted\r\ncontent-length: {}\r\n", body.len());
                for (name, value) in headers {
                    head.push_str(&format!("{name}: {value}\r\n"));
                }
                head.push_str("\r\n");
                state.answered.lock().unwrap().push(Instant::now());
                if stream.write_all(format!("{head}{body}").as_bytes()).await.is_err() {
                    return;
                }
            }
            Step::Cut => return,
            Step::Hang => std::future::pending().await,
        }
    }
}

async fn read_request(stream: &mut BufReader<TcpStream>) -> Option<Seen> {
    let mut line = String::new();
    stream.read_line(&mut line).await.ok().filter(|n| *n > 0)?;
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_owned();
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        stream.read_line(&mut line).await.ok().filter(|n| *n > 0)?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (name, value) = line.split_once(':')?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
    }
    let header = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
    let mut body = Vec::new();
    if let Some(length) = header("content-length") {
        body.resize(length.parse().ok()?, 0);
        stream.read_exact(&mut body).await.ok()?;
    } else if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut size = String::new();
            stream.read_line(&mut size).await.ok()?;
            let size = usize::from_str_radix(size.trim(), 16).ok()?;
            let mut chunk = vec![0; size + 2];
            stream.read_exact(&mut chunk).await.ok()?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    }
    Some(Seen { method, headers, body, at: Instant::now() })
}
