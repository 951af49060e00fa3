//! `iop models`: the models of the fleet's Ollama servers, through an edge (admin key) —
//! `pull` (a progress bar per target, exit status 0 only when every target succeeded),
//! `rm`, `ls` (what each provider holds) and `ps` (what each has loaded). `--node` and
//! `--provider` narrow the targets; by default every enabled Ollama provider of a
//! connected node.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};

use serde_json::{Value, json};

use super::edge_api::EdgeApi;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    api: EdgeApi,
}

#[derive(Debug, clap::Args)]
struct Select {
    /// Only this node's Ollama providers.
    #[arg(long)]
    node: Option<String>,
    /// Only Ollama providers with this id.
    #[arg(long)]
    provider: Option<String>,
}

impl Select {
    fn query(&self) -> String {
        let mut pairs = Vec::new();
        if let Some(node) = &self.node {
            pairs.push(format!("node={}", urlencode(node)));
        }
        if let Some(provider) = &self.provider {
            pairs.push(format!("provider={}", urlencode(provider)));
        }
        if pairs.is_empty() {
            String::new()
        } else {
            format!("?{}", pairs.join("&"))
        }
    }

    fn selects(&self, node: &str, provider: &str) -> bool {
        self.node.as_deref().is_none_or(|n| n == node)
            && self.provider.as_deref().is_none_or(|p| p == provider)
    }
}

fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Pull a model onto the Ollama servers, with progress per target.
    Pull {
        /// The model, as Ollama names it (`llama3.2:3b`).
        model: String,
        #[command(flatten)]
        select: Select,
    },
    /// Delete a model from the Ollama servers.
    Rm {
        model: String,
        #[command(flatten)]
        select: Select,
    },
    /// List the models each Ollama server holds.
    Ls {
        #[command(flatten)]
        select: Select,
    },
    /// List the models each Ollama server has loaded.
    Ps {
        #[command(flatten)]
        select: Select,
    },
}

pub async fn run(args: Args) -> super::Result {
    match &args.command {
        Command::Pull { model, select } => pull(&args.api, model, select).await,
        Command::Rm { model, select } => {
            let client = args.api.client()?;
            let url = args.api.url(&format!("/api/delete{}", select.query()));
            let answer = args
                .api
                .send(client.delete(url).json(&json!({"model": model})))
                .await?;
            for result in answer["results"].as_array().into_iter().flatten() {
                let target = format!(
                    "{}/{}",
                    str_of(&result["node"]),
                    str_of(&result["provider"])
                );
                match result["error"].as_str() {
                    Some(error) => println!("{target:<24} {error}"),
                    None => println!("{target:<24} deleted {model}"),
                }
            }
            Ok(())
        }
        Command::Ls { select } => {
            let client = args.api.client()?;
            let answer = args
                .api
                .send(client.get(args.api.url("/admin/models")))
                .await?;
            println!("{:<16} {:<16} MODEL", "NODE", "PROVIDER");
            for provider in answer["providers"].as_array().into_iter().flatten() {
                let (node, id) = (str_of(&provider["node"]), str_of(&provider["provider"]));
                if !select.selects(node, id) {
                    continue;
                }
                for model in provider["models"].as_array().into_iter().flatten() {
                    println!("{node:<16} {id:<16} {}", str_of(model));
                }
            }
            Ok(())
        }
        Command::Ps { select } => {
            let client = args.api.client()?;
            let url = args.api.url(&format!(
                "/api/ps{}{}fleet=true",
                select.query(),
                if select.query().is_empty() { "?" } else { "&" }
            ));
            let answer = args.api.send(client.get(url)).await?;
            println!(
                "{:<16} {:<16} {:<32} {:>12} UNTIL",
                "NODE", "PROVIDER", "MODEL", "SIZE"
            );
            for model in answer["models"].as_array().into_iter().flatten() {
                println!(
                    "{:<16} {:<16} {:<32} {:>12} {}",
                    str_of(&model["node"]),
                    str_of(&model["provider"]),
                    str_of(&model["name"]),
                    megabytes(model["size"].as_u64()),
                    str_of(&model["expires_at"]),
                );
            }
            Ok(())
        }
    }
}

fn str_of(v: &Value) -> &str {
    v.as_str().unwrap_or("")
}

fn megabytes(bytes: Option<u64>) -> String {
    bytes.map_or_else(String::new, |b| format!("{:.1} MB", b as f64 / 1e6))
}

/// One target's line of the progress display.
#[derive(Debug, Default)]
struct Bar {
    status: String,
    completed: Option<u64>,
    total: Option<u64>,
    ended: Option<Result<(), String>>,
}

impl Bar {
    fn render(&self, target: &str) -> String {
        match &self.ended {
            Some(Ok(())) => return format!("{target:<24} success"),
            Some(Err(e)) => return format!("{target:<24} failed: {e}"),
            None => {}
        }
        match (self.completed, self.total) {
            (Some(done), Some(total)) if total > 0 => {
                let share = (done as f64 / total as f64).clamp(0.0, 1.0);
                let filled = (share * 30.0).round() as usize;
                format!(
                    "{target:<24} {:<20} [{}{}] {:>3.0}% {} / {}",
                    self.status,
                    "#".repeat(filled),
                    "-".repeat(30 - filled),
                    share * 100.0,
                    megabytes(Some(done)),
                    megabytes(Some(total)),
                )
            }
            _ => format!("{target:<24} {}", self.status),
        }
    }
}

/// Pulls `model`, drawing a bar per target (redrawn in place on a terminal; elsewhere a
/// line whenever a target's status changes or its progress passes a quarter).
async fn pull(api: &EdgeApi, model: &str, select: &Select) -> super::Result {
    let client = api.client()?;
    let mut request = client
        .post(api.url(&format!("/api/pull{}", select.query())))
        .json(&json!({"model": model}));
    if let Some(key) = &api.api_key {
        request = request.bearer_auth(key);
    }
    let mut response = request
        .send()
        .await
        .map_err(|e| format!("cannot reach the edge at {}: {e}", api.url))?;
    if !response.status().is_success() {
        let status = response.status();
        let body: Value = response.json().await.unwrap_or_default();
        let message = body["error"]
            .as_str()
            .map_or_else(|| body.to_string(), String::from);
        return Err(format!("the edge answered {status}: {message}").into());
    }
    let terminal = std::io::stdout().is_terminal();
    let mut bars: BTreeMap<String, Bar> = BTreeMap::new();
    let mut drawn = 0;
    let mut pending = Vec::new();
    let mut last: Option<Value> = None;
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| format!("the pull's progress stream broke: {e}"))?
    {
        pending.extend_from_slice(&chunk);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let Ok(line) = serde_json::from_slice::<Value>(&line) else {
                continue;
            };
            let (Some(node), Some(provider)) = (line["node"].as_str(), line["provider"].as_str())
            else {
                last = Some(line);
                continue;
            };
            let target = format!("{node}/{provider}");
            let bar = bars.entry(target.clone()).or_default();
            let before = bar.render(&target);
            let quarter = |b: &Bar| match (b.completed, b.total) {
                (Some(d), Some(t)) if t > 0 => d * 4 / t,
                _ => 0,
            };
            let (old_status, old_quarter) = (bar.status.clone(), quarter(bar));
            if let Some(error) = line["error"].as_str() {
                bar.ended = Some(Err(error.to_string()));
            } else if line["status"] == "success" {
                bar.ended = Some(Ok(()));
            } else {
                bar.status = str_of(&line["status"]).to_string();
                bar.completed = line["completed"].as_u64();
                bar.total = line["total"].as_u64();
            }
            if terminal {
                let mut out = std::io::stdout().lock();
                if drawn > 0 {
                    let _ = write!(out, "\x1b[{drawn}A");
                }
                for (name, bar) in &bars {
                    let _ = writeln!(out, "\x1b[2K{}", bar.render(name));
                }
                drawn = bars.len();
                let _ = out.flush();
            } else if bar.ended.is_some() || bar.status != old_status || quarter(bar) != old_quarter
            {
                let now = bar.render(&target);
                if now != before {
                    println!("{now}");
                }
            }
        }
    }
    match last {
        Some(line) if line["status"] == "success" => {
            println!("pulled {model} onto {} target(s)", bars.len());
            Ok(())
        }
        Some(line) => Err(str_of(&line["error"]).to_string().into()),
        None => Err("the edge ended the pull's progress without an outcome".into()),
    }
}
