package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/nats-io/nats.go/jetstream"
)

// catchupOpts are the extras of a jetbox catch-up.
type catchupOpts struct {
	recvSlot   string         // also create this slot before the load, for pg_recvlogical
	env        []string       // extra environment of the measured jetbox
	onStart    func(*process) // called once the measured jetbox started
	beforeStop func()         // called before it is stopped
	payload    int            // payload bytes per row; 0: cfg.PayloadSize
}

// jetboxCatchup measures jetbox draining a backlog: the slot exists before
// rows rows are committed in transactions of txRows, then jetbox starts and
// the clock runs until the stream holds them all. It returns the WAL position
// after the load (where pg_recvlogical on opts.recvSlot stops).
func (b *bench) jetboxCatchup(ctx context.Context, name string, d deployment, rows, txRows int, opts catchupOpts) (*throughput, string) {
	res := &throughput{Name: name, Events: rows}
	b.log.Info().Str("workload", name).Int("rows", rows).Int("tx_rows", txRows).Msg("catch-up: setting up")
	if err := b.prime(ctx, d, decoder.OutboxDDL); err != nil {
		res.Err = fmt.Errorf("prime: %w", err)
		return res, ""
	}
	if opts.recvSlot != "" {
		if err := b.srv.exec(ctx, d.db, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", opts.recvSlot); err != nil {
			res.Err = fmt.Errorf("create slot %s: %w", opts.recvSlot, err)
			return res, ""
		}
	}
	payload := b.cfg.PayloadSize
	if opts.payload > 0 {
		payload = opts.payload
	}
	if err := b.load(ctx, d.db, rows, txRows, payload); err != nil {
		res.Err = err
		return res, ""
	}
	endLSN, err := b.currentLSN(ctx)
	if err != nil {
		res.Err = err
		return res, ""
	}
	b.log.Info().Str("workload", name).Msg("catch-up: starting jetbox")
	start := func() (*process, error) {
		p, err := b.startJetbox(d, opts.env...)
		if err == nil && opts.onStart != nil {
			opts.onStart(p)
		}
		return p, err
	}
	stop := func(p *process) error {
		if opts.beforeStop != nil {
			opts.beforeStop()
		}
		return stopJetbox(p)
	}
	res.Err = b.measureDrain(ctx, res, d.stream, start, stop)
	if res.Err == nil {
		res.Err = b.verify(ctx, d.db, d.stream, true)
	}
	return res, endLSN
}

// measureDrain starts a forwarder with start, waits until stream holds
// res.Events messages and fills in res: elapsed time, stored span, CPU and
// the forwarder's peak RSS. It then stops the forwarder with stop.
func (b *bench) measureDrain(ctx context.Context, res *throughput, stream string, start func() (*process, error), stop func(*process) error) error {
	if err := b.settle(ctx); err != nil {
		return err
	}
	m, err := b.startMeter(nil)
	if err != nil {
		return err
	}
	p, err := start()
	if err != nil {
		return err
	}
	defer p.kill() // a no-op after stop
	done, err := b.waitStored(ctx, stream, uint64(res.Events), p)
	if err != nil {
		return err
	}
	res.Elapsed = done.Sub(p.started)
	if res.CPU, err = m.read(p, false); err != nil {
		return err
	}
	if res.Host, err = m.hostUsage(); err != nil {
		return err
	}
	if res.RSS, err = peakRSS(p.pid()); err != nil {
		return err
	}
	if err := stop(p); err != nil {
		return err
	}
	first, last, err := b.storedSpan(ctx, stream, 1, uint64(res.Events))
	if err != nil {
		return err
	}
	res.Span = last.Sub(first)
	b.log.Info().Str("workload", res.Name).Stringer("elapsed", res.Elapsed).Float64("events_per_s", res.rate()).Msg("drained")
	return nil
}

// recvlogical measures Postgres' walsender alone: pg_recvlogical decodes the
// same WAL through pgoutput on slot (created beside jetbox's before the load)
// to /dev/null, up to endLSN.
func (b *bench) recvlogical(ctx context.Context, d deployment, slot, endLSN string, events int) *throughput {
	res := &throughput{Name: "pg_recvlogical, pgoutput → /dev/null (raw walsender)", Events: events,
		Note: "rate over its whole run"}
	if endLSN == "" {
		res.Err = fmt.Errorf("skipped: the catch-up it shares the WAL with failed")
		return res
	}
	if err := b.settle(ctx); err != nil {
		res.Err = err
		return res
	}
	b.log.Info().Str("workload", "pg_recvlogical").Msg("starting")
	m, err := b.startMeter(nil)
	if err != nil {
		res.Err = err
		return res
	}
	p, err := startProcess("pg_recvlogical", b.logPath("pg_recvlogical"), nil, filepath.Join(b.srv.pgBin, "pg_recvlogical"),
		"-d", b.srv.dsn(d.db), "--slot", slot, "--start", "--no-loop", "-o", "proto_version=1",
		"-o", "publication_names=jetbox", "-f", os.DevNull, "--endpos", endLSN)
	if err != nil {
		res.Err = err
		return res
	}
	defer p.kill()
	select {
	case <-p.done:
	case <-time.After(b.cfg.Timeout):
		res.Err = fmt.Errorf("pg_recvlogical not done after %s", b.cfg.Timeout)
		return res
	case <-ctx.Done():
		res.Err = ctx.Err()
		return res
	}
	res.Elapsed = time.Since(p.started)
	if p.waitErr != nil {
		res.Err = fmt.Errorf("pg_recvlogical: %w: %s", p.waitErr, p.logTail(1024))
		return res
	}
	if res.CPU, res.Err = m.read(nil, false); res.Err != nil {
		return res
	}
	res.CPU.NATS, res.CPU.NATSKernel = notMeasured, notMeasured
	res.CPU.Client, _ = p.cpu()
	res.Err = b.slotReached(ctx, slot, endLSN)
	return res
}

// slotReached checks that pg_recvlogical confirmed the slot up to endLSN,
// i.e. it decoded the whole load.
func (b *bench) slotReached(ctx context.Context, slot, endLSN string) error {
	conn, err := pgx.Connect(ctx, b.srv.dsn("postgres"))
	if err != nil {
		return fmt.Errorf("connect to postgres: %w", err)
	}
	defer conn.Close(context.Background())
	var confirmed string
	if err := conn.QueryRow(ctx, "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&confirmed); err != nil {
		return fmt.Errorf("read slot %s: %w", slot, err)
	}
	got, err1 := pglogrepl.ParseLSN(confirmed)
	want, err2 := pglogrepl.ParseLSN(endLSN)
	if err1 != nil || err2 != nil {
		return fmt.Errorf("parse LSNs %q, %q", confirmed, endLSN)
	}
	if got < want {
		return fmt.Errorf("slot %s confirmed %s, short of the load's end %s", slot, got, want)
	}
	return nil
}

// relayDeployment is where the polling relay runs (catch-up, then steady).
var relayDeployment = newDeployment("relay", "")

// relayCatchup measures the polling relay draining the same backlog as jetbox.
func (b *bench) relayCatchup(ctx context.Context, rows, txRows int) *throughput {
	d := relayDeployment
	res := &throughput{Name: fmt.Sprintf("polling relay (SKIP LOCKED, batch %d, %s poll)", b.cfg.RelayBatch, b.cfg.RelayPoll), Events: rows}
	b.log.Info().Str("workload", "polling relay").Int("rows", rows).Msg("catch-up: setting up")
	if err := b.srv.createDatabase(ctx, d.db, relayDDL); err != nil {
		res.Err = err
		return res
	}
	if err := b.createStream(ctx, d.stream, d.prefix, false); err != nil {
		res.Err = err
		return res
	}
	if err := b.load(ctx, d.db, rows, txRows, b.cfg.PayloadSize); err != nil {
		res.Err = err
		return res
	}
	res.Err = b.measureDrain(ctx, res, d.stream, func() (*process, error) { return b.startRelay(d) },
		func(p *process) error { return p.stop(30 * time.Second) })
	if res.Err == nil {
		res.Err = b.verifyRelay(ctx, d)
	}
	return res
}

// startRelay runs the polling relay for d in a child process.
func (b *bench) startRelay(d deployment) (*process, error) {
	return startProcess("polling relay", b.logPath("relay"), []string{roleEnv + "=" + roleRelay}, b.self,
		"-postgres-url", b.srv.dsn(d.db), "-nats-url", b.srv.natsURL, "-stream", d.stream, "-subject-prefix", d.prefix,
		"-batch", strconv.Itoa(b.cfg.RelayBatch), "-poll", b.cfg.RelayPoll.String())
}

// verifyRelay checks the relay's stream against its table, and that the
// relay marked every row published.
func (b *bench) verifyRelay(ctx context.Context, d deployment) error {
	if err := b.verify(ctx, d.db, d.stream, false); err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, b.srv.dsn(d.db))
	if err != nil {
		return fmt.Errorf("connect to database %s: %w", d.db, err)
	}
	defer conn.Close(context.Background())
	var unmarked int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM public.outbox WHERE published_at IS NULL").Scan(&unmarked); err != nil {
		return fmt.Errorf("count unmarked rows: %w", err)
	}
	if unmarked > 0 {
		return fmt.Errorf("%d rows published but not marked", unmarked)
	}
	return nil
}

// createStream creates a stream configured as jetbox creates its own (file
// storage, one replica), capturing prefix.>; batch also allows fast-ingest
// batch publishing. Its duplicate window is the one jetbox gives an
// exactly-once stream, or JETBOX_DUPLICATE_WINDOW when set, the window the
// bench's jetbox then creates its streams with too (it inherits the
// environment).
func (b *bench) createStream(ctx context.Context, name, prefix string, batch bool) error {
	window := sink.ExactlyOnceDuplicateWindow
	if v := os.Getenv("JETBOX_DUPLICATE_WINDOW"); v != "" {
		w, err := time.ParseDuration(v)
		if err != nil {
			return fmt.Errorf("JETBOX_DUPLICATE_WINDOW=%q: %w (give a duration such as 2m)", v, err)
		}
		window = w
	}
	_, err := b.srv.js.CreateStream(ctx, jetstream.StreamConfig{
		Name: name, Subjects: []string{prefix + ".>"}, Storage: jetstream.FileStorage, Replicas: 1,
		Duplicates: window, AllowBatchPublish: batch,
	})
	if err != nil {
		return fmt.Errorf("create stream %s: %w", name, err)
	}
	return nil
}

// bigTx measures jetbox on one transaction of rows rows: its peak RSS must not
// grow with the transaction (nothing buffers a whole transaction).
func (b *bench) bigTx(ctx context.Context, rows int) *throughput {
	name := fmt.Sprintf("jetbox, one %s-row transaction", groupDigits(float64(rows)))
	res, _ := b.jetboxCatchup(ctx, name, newDeployment("bigtx", "dedup"), rows, rows, catchupOpts{})
	return res
}
