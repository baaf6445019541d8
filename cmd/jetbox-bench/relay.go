package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// relayDDL is the polling relay's copy of the outbox: the README's table plus
// the column the relay marks, and the partial index a relay needs so that
// finding unpublished rows stays cheap.
const relayDDL = decoder.OutboxDDL + `;
ALTER TABLE public.outbox ADD COLUMN published_at timestamptz;
CREATE INDEX outbox_unpublished ON public.outbox (created_at) WHERE published_at IS NULL`

// relayConfig configures the polling relay.
type relayConfig struct {
	PostgresURL, NatsURL string
	Stream, Prefix       string
	Batch                int           // rows claimed per round
	Poll                 time.Duration // pause when a round found nothing
	PublishTimeout       time.Duration // wait for a round's acks
}

// relay is the polling relay written for the comparison, the way such relays
// are usually written: each round, in one transaction, claim a batch of
// unpublished rows (FOR UPDATE SKIP LOCKED, so several relays could share the
// table), publish them asynchronously with Nats-Msg-Id = id, wait for every
// ack, mark them published and commit; sleep when a round found nothing. A
// failed round rolls back and its rows are published again (dedup absorbs it).
type relay struct {
	cfg  relayConfig
	conn *pgx.Conn
	js   jetstream.JetStream
	ids  []string
}

const (
	relayClaim = `SELECT id::text, aggregate_type, event_type, payload::text FROM public.outbox
WHERE published_at IS NULL ORDER BY created_at LIMIT $1 FOR UPDATE SKIP LOCKED`
	relayMark = `UPDATE public.outbox SET published_at = now() WHERE id = ANY($1::uuid[])`
)

// runRelayChild parses the relay's flags and runs it until ctx ends.
func runRelayChild(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet(roleRelay, flag.ContinueOnError)
	var c relayConfig
	fs.StringVar(&c.PostgresURL, "postgres-url", "", "Postgres URL of the outbox's database")
	fs.StringVar(&c.NatsURL, "nats-url", "", "NATS URL")
	fs.StringVar(&c.Stream, "stream", "", "stream to publish to (must exist)")
	fs.StringVar(&c.Prefix, "subject-prefix", "", "subjects are <prefix>.<aggregate_type>.<event_type>")
	fs.IntVar(&c.Batch, "batch", 500, "rows per round")
	fs.DurationVar(&c.Poll, "poll", 100*time.Millisecond, "pause after an empty round")
	fs.DurationVar(&c.PublishTimeout, "publish-timeout", 30*time.Second, "wait this long for a round's acks")
	if err := fs.Parse(args); err != nil {
		return err
	}
	return runRelay(ctx, c)
}

// runRelay connects to both sides and relays until ctx ends; it then
// finishes the round in progress and returns nil.
func runRelay(ctx context.Context, cfg relayConfig) error {
	conn, err := pgx.Connect(ctx, cfg.PostgresURL)
	if err != nil {
		return fmt.Errorf("connect to postgres: %w", err)
	}
	defer conn.Close(context.Background())
	nc, err := nats.Connect(cfg.NatsURL, nats.Name("polling-relay"))
	if err != nil {
		return fmt.Errorf("connect to nats: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(2*cfg.Batch))
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	r := &relay{cfg: cfg, conn: conn, js: js, ids: make([]string, 0, cfg.Batch)}
	for {
		// A stop lets the round in progress finish (mark and commit what it
		// published); it is bounded by the publish timeout.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.PublishTimeout+10*time.Second)
		n, err := r.round(rctx)
		cancel()
		switch {
		case err != nil:
			return err
		case ctx.Err() != nil:
			return nil
		case n > 0:
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(cfg.Poll):
		}
	}
}

// round claims, publishes and marks one batch; it returns the rows relayed.
func (r *relay) round(ctx context.Context) (int, error) {
	tx, err := r.conn.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }() // a no-op after Commit
	futures, err := r.publishClaimed(ctx, tx)
	if err != nil || len(futures) == 0 {
		return 0, err
	}
	if err := r.awaitAcks(futures); err != nil {
		return 0, err
	}
	if _, err := tx.Exec(ctx, relayMark, r.ids); err != nil {
		return 0, fmt.Errorf("mark %d rows published: %w", len(r.ids), err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("commit: %w", err)
	}
	return len(futures), nil
}

// publishClaimed claims a batch in tx and publishes each row asynchronously.
func (r *relay) publishClaimed(ctx context.Context, tx pgx.Tx) ([]jetstream.PubAckFuture, error) {
	rows, err := tx.Query(ctx, relayClaim, r.cfg.Batch)
	if err != nil {
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	defer rows.Close()
	r.ids = r.ids[:0]
	var futures []jetstream.PubAckFuture
	for rows.Next() {
		var id, aggType, evType string
		var payload []byte
		if err := rows.Scan(&id, &aggType, &evType, &payload); err != nil {
			return nil, fmt.Errorf("read claimed row: %w", err)
		}
		msg := &nats.Msg{Subject: r.cfg.Prefix + "." + aggType + "." + evType, Data: payload, Header: nats.Header{}}
		fut, err := r.js.PublishMsgAsync(msg, jetstream.WithMsgID(id))
		if err != nil {
			return nil, fmt.Errorf("publish %s: %w", id, err)
		}
		r.ids = append(r.ids, id)
		futures = append(futures, fut)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	return futures, nil
}

// awaitAcks waits until JetStream acked every future of the round.
func (r *relay) awaitAcks(futures []jetstream.PubAckFuture) error {
	timeout := time.NewTimer(r.cfg.PublishTimeout)
	defer timeout.Stop()
	for _, f := range futures {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			return fmt.Errorf("publish %s: %w", f.Msg().Header.Get(jetstream.MsgIDHeader), err)
		case <-timeout.C:
			return errors.New("no acks for the round within the publish timeout")
		}
	}
	return nil
}
