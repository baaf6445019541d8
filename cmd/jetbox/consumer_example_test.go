package main

// The consumer of docs/consumers.md: how a downstream Go service applies
// jetbox's events exactly once, in order. docs/consumers.md quotes the parts
// between "guide:begin NAME" and "guide:end" verbatim (TestConsumerGuideQuotesCode
// keeps them equal), and TestConsumerGuide runs this code against a real
// Postgres, a real NATS server and the real jetbox binary.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/sink/format"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// guide:begin schema
// consumerSchema is the consumer's own tables (in its own database): the inbox,
// one row per message acted on; the position of the last message applied; and
// the messages the server gave up on.
const consumerSchema = `
CREATE TABLE inbox (
  msg_id     text        PRIMARY KEY,   -- Nats-Msg-Id: the outbox row id
  stream_seq bigint      NOT NULL,
  handled_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE consumer_position (
  consumer   text   PRIMARY KEY,
  source     text   NOT NULL,           -- Jetbox-Source of the last message applied
  commit_lsn bigint NOT NULL,           -- its Jetbox-Commit-LSN
  tx_index   bigint NOT NULL            -- and its Jetbox-Tx-Index
);
CREATE TABLE dead_letters (
  msg_id     text        PRIMARY KEY,
  stream_seq bigint      NOT NULL,
  subject    text        NOT NULL,
  data       bytea       NOT NULL,
  deliveries int         NOT NULL,
  noted_at   timestamptz NOT NULL DEFAULT now()
);`

// guide:end

// guide:begin consumer
// billingConsumer is the durable pull consumer every instance of the billing
// service shares.
func billingConsumer() jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:       "billing",        // kept by the server across restarts of the service
		FilterSubject: "outbox.order.>", // the events this service needs (dead letters are outbox._dlq.>)
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy, // a message counts as done only when acked
		AckWait:       30 * time.Second,            // redelivered when not acked by then: above the slowest side effect
		MaxDeliver:    5,                           // then the server gives up and sends the max-deliveries advisory
		MaxAckPending: 1,                           // one message in flight: side effects in stream order
	}
}

// guide:end

// guide:begin position
// parsePosition reads where a message's row sits in the WAL: its
// transaction's commit LSN, then its index among the transaction's outbox
// rows (format is github.com/jetbox-dev/jetbox/sink/format: the standard
// library only).
func parsePosition(h nats.Header) (format.Position, error) {
	pos, ok := format.ParsePosition(h)
	if !ok {
		return format.Position{}, errors.New("no valid " + format.HeaderCommitLSN + " and " + format.HeaderTxIndex + " headers: not a jetbox message")
	}
	return pos, nil
}

// guide:end

// guide:begin handler
// billing is one instance of the service. It handles one message at a time.
type billing struct {
	db    *pgx.Conn                                                     // the service's database
	apply func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error // the side effect, in tx
	retry time.Duration                                                 // delay before a failed message is redelivered

	// What became of the messages: export them as metrics.
	applied, duplicates, stale, failed atomic.Int64
}

// run handles messages until ctx ends.
func (b *billing) run(ctx context.Context, cons jetstream.Consumer) error {
	for {
		// Next pulls one message when this instance is free, so a message never
		// waits in a busy instance's buffer while another instance is idle.
		msg, err := cons.Next(jetstream.FetchContext(ctx))
		switch {
		case ctx.Err() != nil:
			return nil // a message in hand is redelivered after AckWait
		case errors.Is(err, nats.ErrTimeout), errors.Is(err, jetstream.ErrNoHeartbeat):
			continue
		case err != nil:
			return fmt.Errorf("next message: %w", err)
		}
		if err := b.handle(ctx, msg); err != nil && ctx.Err() == nil {
			return err
		}
	}
}

// handle commits the message's transaction, then acks.
func (b *billing) handle(ctx context.Context, msg jetstream.Msg) error {
	outcome, err := b.process(ctx, msg)
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		// Try again later. After MaxDeliver attempts the server stops delivering
		// it and sends the max-deliveries advisory (see recordDeadLetters).
		b.failed.Add(1)
		return msg.NakWithDelay(b.retry)
	}
	switch outcome {
	case "applied":
		b.applied.Add(1)
	case "duplicate":
		b.duplicates.Add(1)
	case "stale":
		b.stale.Add(1)
	}
	// Only now, after COMMIT. Should the service die before this ack reaches
	// the server, the message comes back after AckWait and is a duplicate.
	return msg.Ack()
}

// process runs one transaction: the inbox row, the position, the side effect.
func (b *billing) process(ctx context.Context, msg jetstream.Msg) (string, error) {
	md, err := msg.Metadata()
	if err != nil {
		return "", err
	}
	id := msg.Headers().Get(jetstream.MsgIDHeader)
	pos, err := parsePosition(msg.Headers())
	if err != nil || id == "" {
		return "", fmt.Errorf("stream sequence %d: not a jetbox event (id %q): %v", md.Sequence.Stream, id, err)
	}
	tx, err := b.db.Begin(ctx)
	if err != nil {
		return "", err
	}
	defer tx.Rollback(ctx) // after Commit, a no-op

	// 1. The inbox. If another instance is handling this id right now (it was
	// redelivered while that one was slow), this INSERT waits for its
	// transaction: once it commits, this inserts nothing; if it rolls back,
	// this one proceeds.
	tag, err := tx.Exec(ctx, `INSERT INTO inbox (msg_id, stream_seq) VALUES ($1, $2)
		ON CONFLICT (msg_id) DO NOTHING`, id, md.Sequence.Stream)
	if err != nil {
		return "", err
	}
	if tag.RowsAffected() == 0 {
		return "duplicate", nil // already done: ack without acting
	}

	// 2. The position. With MaxAckPending 1 messages are applied in stream
	// order, so one at or before the last applied position is done already:
	// a copy stored again beyond the duplicate window, after its inbox row
	// was pruned. Positions compare only within one WAL history (source).
	source := msg.Headers().Get(format.HeaderSource)
	var lastSource string
	var lsn, index int64
	err = tx.QueryRow(ctx, `SELECT source, commit_lsn, tx_index FROM consumer_position
		WHERE consumer = 'billing' FOR UPDATE`).Scan(&lastSource, &lsn, &index)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return "", err
	}
	if source == lastSource && !(format.Position{CommitLSN: uint64(lsn), TxIndex: int(index)}).Less(pos) {
		return "stale", tx.Commit(ctx)
	}

	// 3. The side effect, and the new position, in the same transaction.
	if err := b.apply(ctx, tx, msg); err != nil {
		return "", fmt.Errorf("apply %s: %w", id, err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO consumer_position (consumer, source, commit_lsn, tx_index)
		VALUES ('billing', $1, $2, $3) ON CONFLICT (consumer) DO UPDATE
		SET source = excluded.source, commit_lsn = excluded.commit_lsn, tx_index = excluded.tx_index`,
		source, int64(pos.CommitLSN), pos.TxIndex); err != nil {
		return "", err
	}
	return "applied", tx.Commit(ctx)
}

// guide:end

// guide:begin deadletters
// subscribeMaxDeliveries subscribes to the advisory the server sends when it
// gives up on a message of the consumer (MaxDeliver attempts).
func subscribeMaxDeliveries(nc *nats.Conn, stream, consumer string) (*nats.Subscription, error) {
	sub, err := nc.SubscribeSync("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES." + stream + "." + consumer)
	if err != nil {
		return nil, err
	}
	return sub, nc.Flush() // the server knows the subscription from now on
}

// recordDeadLetters stores each message the server gave up on, for a person
// to look at, until ctx ends.
func recordDeadLetters(ctx context.Context, sub *nats.Subscription, stream jetstream.Stream, db *pgx.Conn) error {
	for {
		m, err := sub.NextMsgWithContext(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			return fmt.Errorf("advisory: %w", err)
		}
		var adv struct {
			StreamSeq  uint64 `json:"stream_seq"`
			Deliveries int    `json:"deliveries"`
		}
		if err := json.Unmarshal(m.Data, &adv); err != nil {
			return fmt.Errorf("advisory %q: %w", m.Data, err)
		}
		raw, err := stream.GetMsg(ctx, adv.StreamSeq)
		if err != nil {
			return fmt.Errorf("dead letter at stream sequence %d: %w", adv.StreamSeq, err)
		}
		if _, err := db.Exec(ctx, `INSERT INTO dead_letters (msg_id, stream_seq, subject, data, deliveries)
			VALUES ($1, $2, $3, $4, $5) ON CONFLICT (msg_id) DO NOTHING`,
			raw.Header.Get(jetstream.MsgIDHeader), adv.StreamSeq, raw.Subject, raw.Data, adv.Deliveries); err != nil {
			return fmt.Errorf("dead letter at stream sequence %d: %w", adv.StreamSeq, err)
		}
	}
}

// guide:end
