package main

import (
	"context"
	"fmt"
	"syscall"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// loadTx inserts one transaction of rows, numbered from first; each payload
// renders to size bytes as jsonb text ({"n": 123456, "pad": "xx…"}).
const loadTx = `INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'order', (g)::text, 'OrderPlaced', jsonb_build_object('n', g, 'pad', repeat('x', $3::int - 18 - length(g::text)))
FROM generate_series($1::bigint, $1::bigint + $2::bigint - 1) g`

// load commits rows outbox rows in transactions of txRows, with payloads of
// payload bytes, into database db. The commits but the last do not wait
// for the WAL flush (synchronous_commit off): the load is not what is
// measured.
func (b *bench) load(ctx context.Context, db string, rows, txRows, payload int) error {
	conn, err := pgx.Connect(ctx, b.srv.dsn(db))
	if err != nil {
		return fmt.Errorf("connect to database %s: %w", db, err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "SET synchronous_commit TO off"); err != nil {
		return fmt.Errorf("database %s: %w", db, err)
	}
	for first := 1; first <= rows; first += txRows {
		n := min(txRows, rows-first+1)
		if first+n > rows { // the last commit waits for the flush: the WAL ends there (currentLSN)
			if _, err := conn.Exec(ctx, "SET synchronous_commit TO on"); err != nil {
				return fmt.Errorf("database %s: %w", db, err)
			}
		}
		if _, err := conn.Exec(ctx, loadTx, first, n, payload); err != nil {
			return fmt.Errorf("insert rows %d-%d into %s: %w", first, first+n-1, db, err)
		}
	}
	return nil
}

// currentLSN is the server's current WAL insert position.
func (b *bench) currentLSN(ctx context.Context) (string, error) {
	conn, err := pgx.Connect(ctx, b.srv.dsn("postgres"))
	if err != nil {
		return "", fmt.Errorf("connect to postgres: %w", err)
	}
	defer conn.Close(context.Background())
	var lsn string
	if err := conn.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&lsn); err != nil {
		return "", fmt.Errorf("read current WAL position: %w", err)
	}
	return lsn, nil
}

// streamMsgs is the number of messages stream holds.
func (b *bench) streamMsgs(ctx context.Context, stream string) (uint64, error) {
	s, err := b.srv.js.Stream(ctx, stream)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", stream, err)
	}
	return s.CachedInfo().State.Msgs, nil
}

// waitStored waits until stream holds want messages, failing if it holds
// more or if p (the forwarder, may be nil) exits. It returns when the bench
// saw the last one stored.
func (b *bench) waitStored(ctx context.Context, stream string, want uint64, p *process) (time.Time, error) {
	err := b.poll(ctx, p, func() (bool, error) {
		n, err := b.streamMsgs(ctx, stream)
		if err != nil {
			return false, err
		}
		if n > want {
			return false, fmt.Errorf("stream %s holds %d messages, want %d", stream, n, want)
		}
		return n == want, nil
	})
	return time.Now(), err
}

// storedSpan returns when the stream stored its messages first and last
// (server timestamps, the same clock as the bench's).
func (b *bench) storedSpan(ctx context.Context, stream string, first, last uint64) (time.Time, time.Time, error) {
	s, err := b.srv.js.Stream(ctx, stream)
	if err != nil {
		return time.Time{}, time.Time{}, fmt.Errorf("stream %s: %w", stream, err)
	}
	f, err := s.GetMsg(ctx, first)
	if err != nil {
		return time.Time{}, time.Time{}, fmt.Errorf("stream %s seq %d: %w", stream, first, err)
	}
	l, err := s.GetMsg(ctx, last)
	if err != nil {
		return time.Time{}, time.Time{}, fmt.Errorf("stream %s seq %d: %w", stream, last, err)
	}
	return f.Time, l.Time, nil
}

// tableIDs returns the ids of every outbox row in database db.
func (b *bench) tableIDs(ctx context.Context, db string) (map[string]bool, error) {
	conn, err := pgx.Connect(ctx, b.srv.dsn(db))
	if err != nil {
		return nil, fmt.Errorf("connect to database %s: %w", db, err)
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(ctx, "SELECT id::text FROM public.outbox")
	if err != nil {
		return nil, fmt.Errorf("read outbox ids of %s: %w", db, err)
	}
	ids := map[string]bool{}
	var id string
	_, err = pgx.ForEachRow(rows, []any{&id}, func() error { ids[id] = false; return nil })
	if err != nil {
		return nil, fmt.Errorf("read outbox ids of %s: %w", db, err)
	}
	return ids, nil
}

// verify checks that stream holds every outbox row of database db exactly
// once and nothing else; with jetboxOrder, also that the messages' positions
// (Jetbox-Commit-LSN, Jetbox-Tx-Index) increase strictly along the stream.
func (b *bench) verify(ctx context.Context, db, stream string, jetboxOrder bool) error {
	ctx, cancel := context.WithTimeout(ctx, b.cfg.Timeout)
	defer cancel()
	want, err := b.tableIDs(ctx, db)
	if err != nil {
		return err
	}
	c := &streamCheck{stream: stream, want: want, ordered: jetboxOrder}
	if err := b.readStream(ctx, stream, c.add); err != nil {
		return err
	}
	return c.complete()
}

// streamCheck checks a stream's messages, in stream order, against the ids
// committed to the table.
type streamCheck struct {
	stream  string
	want    map[string]bool // committed id → seen in the stream
	ordered bool            // check jetbox's positions too
	seen    int
	last    format.Position
}

// add checks the headers of the message at stream sequence seq.
func (c *streamCheck) add(h nats.Header, seq uint64) error {
	id := h.Get(jetstream.MsgIDHeader)
	done, ok := c.want[id]
	switch {
	case !ok:
		return fmt.Errorf("stream %s seq %d holds id %q, which is not in the table", c.stream, seq, id)
	case done:
		return fmt.Errorf("stream %s holds id %s twice (again at seq %d)", c.stream, id, seq)
	}
	c.want[id] = true
	c.seen++
	if !c.ordered {
		return nil
	}
	pos, ok := format.ParsePosition(h)
	if !ok {
		return fmt.Errorf("stream %s seq %d: no position (%s %q, %s %q)", c.stream, seq,
			format.HeaderCommitLSN, h.Get(format.HeaderCommitLSN), format.HeaderTxIndex, h.Get(format.HeaderTxIndex))
	}
	if !c.last.Less(pos) {
		return fmt.Errorf("stream %s seq %d: position %v is not after the previous %v (commit order broken)", c.stream, seq, pos, c.last)
	}
	c.last = pos
	return nil
}

// complete checks that every committed id was seen.
func (c *streamCheck) complete() error {
	if c.seen != len(c.want) {
		return fmt.Errorf("stream %s holds %d of the %d committed rows", c.stream, c.seen, len(c.want))
	}
	return nil
}

// readStream calls fn with the headers and sequence of every message of
// stream, in stream order.
func (b *bench) readStream(ctx context.Context, stream string, fn func(h nats.Header, seq uint64) error) error {
	s, err := b.srv.js.Stream(ctx, stream)
	if err != nil {
		return fmt.Errorf("stream %s: %w", stream, err)
	}
	total := s.CachedInfo().State.Msgs
	if total == 0 {
		return nil
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return fmt.Errorf("read stream %s: %w", stream, err)
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(4096))
	if err != nil {
		return fmt.Errorf("read stream %s: %w", stream, err)
	}
	defer it.Stop()
	stop := context.AfterFunc(ctx, it.Stop) // Next has no ctx: end it when ctx ends
	defer stop()
	for range total {
		m, err := it.Next()
		if err != nil {
			if ctx.Err() != nil { // a stopped iterator hides why
				err = fmt.Errorf("%w (%w)", err, ctx.Err())
			}
			return fmt.Errorf("read stream %s: %w", stream, err)
		}
		md, err := m.Metadata()
		if err != nil {
			return fmt.Errorf("read stream %s: %w", stream, err)
		}
		if err := fn(m.Headers(), md.Sequence.Stream); err != nil {
			return err
		}
	}
	return nil
}

// settle writes back what earlier work left dirty before a throughput run is
// timed: a CHECKPOINT (the load's heap pages) and a sync of every file system
// (the WAL, the NATS store of the run before). A backlog that built up while
// a forwarder was down was written back long before the forwarder came
// back; without this, the write-back of a large load (gigabytes for
// --scale-rows) runs during the drain, and the NATS server's writes into
// the page cache cost it up to twice the kernel time per message
// (docs/performance.md, "How cost grows with the work"). With
// --drop-caches it then drops the clean page cache (dropPageCache).
func (b *bench) settle(ctx context.Context) error {
	if err := b.srv.exec(ctx, "postgres", "CHECKPOINT"); err != nil {
		return fmt.Errorf("checkpoint before a timed run: %w", err)
	}
	syscall.Sync()
	if b.cfg.DropCaches {
		return dropPageCache()
	}
	return nil
}
