//! The RabbitMQ publisher of the outbox relay (features `outbox` and
//! `amqp`): publisher confirms on a channel of its own, `mandatory`, so an
//! event no queue takes is refused rather than dropped.
//!
//! Each event goes to the publisher's exchange (default: the default
//! exchange, where the routing key names a queue) with its destination as
//! routing key, persistent (`delivery_mode` 2), `content_type`
//! `application/json`, `message_id` = the event's id, and its headers. The
//! consumer runner ([`crate::amqp::Consumer::run_with_id`]) can key its
//! call by that id.

use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};

use super::relay::{Confirm, Message, Publisher};

/// Publishes outbox events to RabbitMQ with publisher confirms; see the
/// [module docs](self). Connects on the first batch, and again after its
/// connection failed.
pub struct RabbitPublisher {
    uri: String,
    exchange: String,
    confirm_timeout: Duration,
    link: Option<(Connection, Channel)>,
}

impl std::fmt::Debug for RabbitPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URI may hold a password.
        f.debug_struct("RabbitPublisher")
            .field("exchange", &self.exchange)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connected", &self.link.is_some())
            .finish_non_exhaustive()
    }
}

impl RabbitPublisher {
    /// A publisher to the broker at `uri` (`amqp://user:pass@host:port/vhost`).
    pub fn new(uri: impl Into<String>) -> Self {
        RabbitPublisher {
            uri: uri.into(),
            exchange: String::new(),
            confirm_timeout: Duration::from_secs(10),
            link: None,
        }
    }

    /// The exchange events go to, with their destination as routing key.
    /// Default `""`, the default exchange: the destination names a queue.
    pub fn exchange(mut self, exchange: impl Into<String>) -> Self {
        self.exchange = exchange.into();
        self
    }

    /// How long a batch waits for its confirms; the ones missing then are
    /// unconfirmed (not counted as attempts) and the connection is
    /// renewed. Default 10 s.
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    async fn channel(&mut self) -> Result<Channel, lapin::Error> {
        if let Some((connection, channel)) = &self.link {
            if connection.status().connected() && channel.status().connected() {
                return Ok(channel.clone());
            }
            self.link = None;
        }
        let connection = Connection::connect(&self.uri, ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        self.link = Some((connection, channel.clone()));
        Ok(channel)
    }

    /// Drops the connection after a failure; the next batch reconnects.
    async fn reset(&mut self) {
        if let Some((connection, _)) = self.link.take() {
            let _ = tokio::time::timeout(Duration::from_secs(1), connection.close(320, "idem relay reconnects".into()))
                .await;
        }
    }
}

fn properties(message: &Message) -> BasicProperties {
    let mut headers = FieldTable::default();
    for (name, value) in message.headers() {
        headers.insert(name.as_str().into(), AMQPValue::LongString(value.as_str().into()));
    }
    let seconds = u64::try_from(message.queued_at_ms() / 1000).unwrap_or(0);
    BasicProperties::default()
        .with_message_id(message.id().into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_timestamp(seconds)
        .with_headers(headers)
}

impl Publisher for RabbitPublisher {
    async fn publish(&mut self, batch: &[Message]) -> Vec<Confirm> {
        let channel = match tokio::time::timeout(self.confirm_timeout, self.channel()).await {
            Ok(Ok(channel)) => channel,
            failed => {
                let reason = match failed {
                    Ok(Err(e)) => format!("connect: {e}"),
                    _ => "connect: timed out".to_owned(),
                };
                self.reset().await;
                return vec![Confirm::Unconfirmed(reason); batch.len()];
            }
        };
        let exchange = ShortString::from(self.exchange.as_str());
        let options = BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() };
        let deadline = crate::clock::deadline_in(self.confirm_timeout);
        // All published first, then all confirms awaited: one round trip's
        // wait for the whole batch.
        let mut pending = Vec::with_capacity(batch.len());
        for message in batch {
            let sent = tokio::time::timeout_at(
                deadline,
                channel.basic_publish(
                    exchange.clone(),
                    message.destination().into(),
                    options,
                    message.payload().as_bytes(),
                    properties(message),
                ),
            )
            .await;
            pending.push(match sent {
                Ok(Ok(confirm)) => Ok(confirm),
                Ok(Err(e)) => Err(format!("publish: {e}")),
                Err(_) => Err("publish: timed out".to_owned()),
            });
        }
        let mut broken = false;
        let mut answers = Vec::with_capacity(batch.len());
        for confirm in pending {
            let answer = match confirm {
                Err(reason) => Confirm::Unconfirmed(reason),
                Ok(confirm) => match tokio::time::timeout_at(deadline, confirm).await {
                    Ok(Ok(Confirmation::Ack(None) | Confirmation::NotRequested)) => Confirm::Sent { duplicate: false },
                    Ok(Ok(Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)))) => {
                        Confirm::Refused(format!("returned: {} {}", returned.reply_code, returned.reply_text))
                    }
                    Ok(Ok(Confirmation::Nack(None))) => Confirm::Refused("nacked by the broker".to_owned()),
                    Ok(Err(e)) => Confirm::Unconfirmed(format!("confirm: {e}")),
                    Err(_) => Confirm::Unconfirmed("confirm: timed out".to_owned()),
                },
            };
            broken |= matches!(answer, Confirm::Unconfirmed(_));
            answers.push(answer);
        }
        if broken {
            self.reset().await;
        }
        answers
    }
}
