package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// scaleRun is one point of the scaling tables: a jetbox catch-up
// (exactly-once, the default delivery) at one size of the work, and beside
// it raw publishing of the same messages (payload and backlog sizes) and
// pg_recvlogical decoding the same WAL (backlog sizes): which side slows
// down as the backlog grows.
type scaleRun struct {
	Kind    string // scaleRows, scalePayload or scaleTx
	Rows    int
	TxRows  int
	Payload int
	Jetbox  *throughput
	Raw     *throughput // scalePayload and scaleRows
	Recv    *throughput // scaleRows only
}

const (
	scaleRows    = "scale-rows"
	scalePayload = "scale-payload"
	scaleTx      = "scale-tx"
)

// scaleWorkloads run only when asked for (--scale, or by name in --only):
// they take long and need disk (10,000,000 rows are about 6 GB of stream).
var scaleWorkloads = []string{scaleRows, scalePayload, scaleTx}

// runScale runs the scaling workloads asked for, each point on a deployment
// of its own that is removed afterwards (stream, slot, database) to free disk.
func (b *bench) runScale(ctx context.Context, rep *Report) {
	c := b.cfg
	point := func(kind string, rows, txRows, payload int) {
		if ctx.Err() != nil {
			return
		}
		run := scaleRun{Kind: kind, Rows: rows, TxRows: txRows, Payload: payload}
		d := newDeployment(fmt.Sprintf("%s_%d_%d_%d", strings.ReplaceAll(kind, "-", "_"), rows, txRows, payload), "exactly-once")
		name := fmt.Sprintf("jetbox, %s rows in transactions of %s, %s-byte payloads", groupDigits(float64(rows)), groupDigits(float64(txRows)), groupDigits(float64(payload)))
		opts := catchupOpts{payload: payload}
		if kind == scaleRows {
			opts.recvSlot = d.slot + "_recv" // slots are the server's, not the database's: one per point
		}
		var endLSN string
		run.Jetbox, endLSN = b.jetboxCatchup(ctx, name, d, rows, txRows, opts)
		if kind == scaleRows {
			run.Recv = b.recvlogical(ctx, d, opts.recvSlot, endLSN, rows)
			b.dropSlot(ctx, d, opts.recvSlot)
		}
		b.drop(ctx, d)
		if kind == scalePayload || kind == scaleRows {
			stream := strings.ToUpper(fmt.Sprintf("rawsize%d", payload))
			run.Raw = b.rawPublishSized(ctx, "raw async publish, "+groupDigits(float64(payload))+" B", stream, rows, jetboxGuarded, payload)
			if err := b.srv.deleteStream(ctx, stream); err != nil {
				b.log.Warn().Err(err).Msg("delete stream")
			}
		}
		rep.Scale = append(rep.Scale, run)
	}
	if c.runs(scaleRows) {
		for _, rows := range c.ScaleRows {
			point(scaleRows, rows, c.TxRows, c.PayloadSize)
		}
	}
	if c.runs(scalePayload) {
		for _, size := range c.ScalePayloads {
			rows := max(1, min(c.Rows, int(c.ScaleBytes/int64(size))))
			point(scalePayload, rows, c.TxRows, size)
		}
	}
	if c.runs(scaleTx) {
		for _, tx := range c.ScaleTx {
			point(scaleTx, max(c.Rows, tx), tx, c.PayloadSize)
		}
	}
}

// drop removes deployment d: its stream, slot and database (not with --keep).
func (b *bench) drop(ctx context.Context, d deployment) {
	if b.cfg.Keep {
		return
	}
	if err := b.srv.deleteStream(ctx, d.stream); err != nil {
		b.log.Warn().Err(err).Msg("delete stream")
	}
	conn, err := pgx.Connect(ctx, b.srv.dsn("postgres"))
	if err != nil {
		b.log.Warn().Err(err).Msg("drop deployment")
		return
	}
	defer conn.Close(context.Background())
	// The stopped forwarder's walsender may take a moment to exit.
	for deadline := time.Now().Add(30 * time.Second); ; {
		_, err = conn.Exec(ctx, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1", d.slot)
		if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
	if err == nil {
		_, err = conn.Exec(ctx, "DROP DATABASE "+pgx.Identifier{d.db}.Sanitize()+" WITH (FORCE)")
	}
	if err != nil {
		b.log.Warn().Err(err).Str("database", d.db).Msg("drop deployment")
	}
}

// dropSlot removes slot from d's database (a floor's slot, before the
// deployment itself is removed; not with --keep).
func (b *bench) dropSlot(ctx context.Context, d deployment, slot string) {
	if b.cfg.Keep {
		return
	}
	if err := b.srv.exec(ctx, d.db, "SELECT pg_drop_replication_slot($1)", slot); err != nil {
		b.log.Warn().Err(err).Str("slot", slot).Msg("drop slot")
	}
}

// printScale writes the scaling tables.
func (r *Report) printScale(w io.Writer) {
	table := func(kind, title, head, sep string, row func(s scaleRun) string) {
		var rows []string
		for _, s := range r.Scale {
			if s.Kind == kind {
				rows = append(rows, row(s))
			}
		}
		if len(rows) == 0 {
			return
		}
		fmt.Fprintf(w, "%s\n\n%s\n%s\n%s\n\n", title, head, sep, strings.Join(rows, "\n"))
	}
	mbps := func(t *throughput, payload int) string {
		if t.rate() <= 0 {
			return "—"
		}
		return fmt.Sprintf("%.1f", t.rate()*float64(payload)/1e6)
	}
	table(scaleRows, "Catch-up by backlog size (exactly-once), beside pg_recvlogical decoding the same WAL and raw async publishing of the same number of messages (same headers and order guard); CPU per event of each process, the NATS server's part in the kernel in parentheses; the NATS server's system calls, page faults and context switches per event; the host's free memory when the drain began and the page cache it reclaimed during it, the part reclaimed by the writing processes themselves in parentheses; the allocations that waited for memory to be compacted; the free memory handed back to the hypervisor:",
		"| rows | transactions of | events/s | elapsed | CPU µs/event: jetbox · Postgres · NATS (kernel) | jetbox peak RSS | pg_recvlogical events/s | raw events/s | raw: NATS CPU µs/event (kernel) | NATS per event: syscalls · faults · switches | free at start · reclaimed (direct) | compaction stalls | handed to the hypervisor | check |", "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
		func(s scaleRun) string {
			t := s.Jetbox
			return fmt.Sprintf("| %s | %s | %s | %s | %s · %s · %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |", groupDigits(float64(s.Rows)), groupDigits(float64(s.TxRows)), groupDigits(t.rate()),
				seconds(t.Elapsed), perEvent(t, t.CPU.Forwarder), perEvent(t, t.CPU.Postgres), natsPerEvent(t), mebibytes(t.RSS), rateOf(s.Recv), rateOf(s.Raw), natsPerEvent(s.Raw),
				syscallsPerEvent(t), reclaim(t), compactions(t), handedBack(t), check(firstErr(t.Err, errOf(s.Recv), errOf(s.Raw))))
		})
	table(scalePayload, "Catch-up by payload size (exactly-once), beside raw async publishing of the same messages (same headers and order guard):",
		"| payload | rows | jetbox events/s | jetbox payload MB/s | raw events/s | raw payload MB/s | jetbox / raw | jetbox peak RSS | check |", "|--:|--:|--:|--:|--:|--:|--:|--:|---|",
		func(s scaleRun) string {
			t, raw := s.Jetbox, s.Raw
			ratio := "—"
			if t.rate() > 0 && raw.rate() > 0 {
				ratio = fmt.Sprintf("%.2f×", t.rate()/raw.rate())
			}
			return fmt.Sprintf("| %s B | %s | %s | %s | %s | %s | %s | %s | %s |", groupDigits(float64(s.Payload)), groupDigits(float64(s.Rows)),
				groupDigits(t.rate()), mbps(t, s.Payload), groupDigits(raw.rate()), mbps(raw, s.Payload), ratio, mebibytes(t.RSS), check(firstErr(t.Err, raw.Err)))
		})
	table(scaleTx, "Catch-up by transaction size (exactly-once):",
		"| rows per transaction | rows | events/s | elapsed | jetbox peak RSS | check |", "|--:|--:|--:|--:|--:|---|",
		func(s scaleRun) string {
			t := s.Jetbox
			return fmt.Sprintf("| %s | %s | %s | %s | %s | %s |", groupDigits(float64(s.TxRows)), groupDigits(float64(s.Rows)), groupDigits(t.rate()),
				seconds(t.Elapsed), mebibytes(t.RSS), check(t.Err))
		})
}

// perEvent is d per event of t, in µs, for a table.
func perEvent(t *throughput, d time.Duration) string {
	if t == nil || t.Events == 0 || d < 0 {
		return "—"
	}
	return micros(d / time.Duration(t.Events))
}

// natsPerEvent is the NATS server's CPU per event of t with its kernel part,
// "12.4 (3.1)", for a table.
func natsPerEvent(t *throughput) string {
	if t == nil || t.Err != nil || t.Events == 0 {
		return "—"
	}
	return perEvent(t, t.CPU.NATS) + " (" + perEvent(t, t.CPU.NATSKernel) + ")"
}

// syscallsPerEvent is the NATS server's system calls, minor page faults and
// context switches per event of t, "1.05 · 0.02 · 0.40", for a table.
func syscallsPerEvent(t *throughput) string {
	if t == nil || t.Err != nil || t.Events == 0 || t.Host == nil {
		return "—"
	}
	per := func(n int64) string {
		if n < 0 {
			return "—"
		}
		return fmt.Sprintf("%.2f", float64(n)/float64(t.Events))
	}
	return per(t.Host.NATSSyscalls) + " · " + per(t.Host.NATSFaults) + " · " + per(t.Host.NATSSwitches)
}

// reclaim is the host's free memory when t began and the page cache reclaimed
// during it, "17.9 · 2.1 (0.3) GiB", for a table.
func reclaim(t *throughput) string {
	if t == nil || t.Err != nil || t.Host == nil {
		return "—"
	}
	gib := func(n int64) string { return fmt.Sprintf("%.1f", float64(n)/(1<<30)) }
	return gib(t.Host.FreeAtStart) + " · " + gib(t.Host.Reclaimed) + " (" + gib(t.Host.DirectReclaimed) + ") GiB"
}

// compactions is the number of allocations that waited for compaction during
// t, for a table.
func compactions(t *throughput) string {
	if t == nil || t.Err != nil || t.Host == nil {
		return "—"
	}
	return groupDigits(float64(t.Host.CompactStalls))
}

// handedBack is the free memory the guest reported to its hypervisor during
// t, for a table ("—" where the kernel does not count it).
func handedBack(t *throughput) string {
	if t == nil || t.Err != nil || t.Host == nil || t.Host.ReportedToHost < 0 {
		return "—"
	}
	return fmt.Sprintf("%.1f GiB", float64(t.Host.ReportedToHost)/(1<<30))
}

// rateOf is t's rate for a table, "—" when it was not measured or failed.
func rateOf(t *throughput) string {
	if t == nil || t.Err != nil || t.rate() <= 0 {
		return "—"
	}
	return groupDigits(t.rate())
}

func errOf(t *throughput) error {
	if t == nil {
		return nil
	}
	return t.Err
}

func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
