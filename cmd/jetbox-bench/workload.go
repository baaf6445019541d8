package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jetbox-dev/jetbox/decoder"
)

// The workload others can compare (--workload) has the shape of the
// published Postgres CDC benchmark of Sequin: one table, changes committed
// in transactions of 100 (its workload generator's batch), row sizes of
// 100, 200, 400 and 1,600 bytes, the sustained rate in changes (ops) per
// second delivered to the broker, and the latency from the change to the
// broker's timestamp (mean and p99 as published, p50 and p99.9 too). jetbox
// publishes the inserts of an outbox only, so every change here is an
// outbox row: ops/s are messages/s. Each row size is run on a deployment of
// its own by jetbox (exactly-once, the default; --workload-delivery) and then by the polling
// relay, each stepping up through cfg.WorkloadRates until a rate is not
// sustained; each stream is checked (every row once, in commit order for
// jetbox) and the deployment dropped.

const workloadName = "workload"

// workloadRun is one forwarder at one row size.
type workloadRun struct {
	Forwarder string
	Size      int          // payload bytes per row
	Steps     []latencyRun // one per rate tried, in order
	Load      []float64    // the host's 1-minute load average at the end of each step (-1: unread)
	Sustained int          // the highest rate kept (≥ 95%, p99 < maxSustainedP99); 0: none
	Check     error        // the stream afterwards: every row once (in commit order for jetbox)
	Err       error        // the set-up failed
}

// best is the step at the sustained rate, or nil.
func (w *workloadRun) best() *latencyRun {
	for i := range w.Steps {
		if w.Steps[i].Rate == w.Sustained && w.Steps[i].sustains() {
			return &w.Steps[i]
		}
	}
	return nil
}

// runWorkload runs the workload at every row size, jetbox then the relay.
func (b *bench) runWorkload(ctx context.Context, rep *Report) {
	for _, size := range b.cfg.WorkloadSizes {
		for _, relay := range []bool{false, true} {
			if ctx.Err() != nil {
				return
			}
			rep.Workload = append(rep.Workload, b.workloadAt(ctx, size, relay))
		}
	}
}

// workloadAt runs one forwarder's steps at one row size on a new deployment.
func (b *bench) workloadAt(ctx context.Context, size int, relay bool) *workloadRun {
	w := &workloadRun{Forwarder: "jetbox, --delivery=" + b.cfg.WorkloadMode, Size: size}
	d := newDeployment(fmt.Sprintf("wl_jetbox_%d", size), b.cfg.WorkloadMode)
	start := func() (*process, error) { return b.startJetbox(d) }
	opts := loadOpts{streams: true, shape: loadShape{payload: size, txRows: b.cfg.WorkloadTx}}
	if relay {
		w.Forwarder = fmt.Sprintf("polling relay (batch %d, %s poll)", b.cfg.RelayBatch, b.cfg.RelayPoll)
		d = newDeployment(fmt.Sprintf("wl_relay_%d", size), "")
		start = func() (*process, error) { return b.startRelay(d) }
		opts.streams = false
	}
	defer b.drop(ctx, d)
	if w.Err = b.workloadSetUp(ctx, d, relay, start); w.Err != nil {
		return w
	}
	ws, err := b.openWriters(ctx, d.db)
	if err != nil {
		w.Err = err
		return w
	}
	defer ws.close()
	opts.send = ws.sendTx(b.cfg.WorkloadTx)
	load, stop, err := b.startSQLLoad(ctx, d, ws, start, opts)
	if err != nil {
		w.Err = err
		return w
	}
	defer load.consumer.stop()
	if !relay {
		load.slot = d.slot
	}
	name := fmt.Sprintf("%s, %d B", w.Forwarder, size)
	for _, rate := range b.cfg.WorkloadRates {
		run := load.step(ctx, name, rate, b.cfg.WorkloadStep)
		w.Steps = append(w.Steps, run)
		w.Load = append(w.Load, loadAverage())
		if !run.sustains() || ctx.Err() != nil {
			break
		}
		w.Sustained = rate
	}
	if err := stop(); err != nil {
		w.Check = err
		return w
	}
	if relay {
		w.Check = b.verifyRelay(ctx, d)
	} else {
		w.Check = b.verify(ctx, d.db, d.stream, true)
	}
	return w
}

// workloadSetUp creates d: for jetbox its database, slot and stream (a
// first run until it streams), for the relay its database and stream.
func (b *bench) workloadSetUp(ctx context.Context, d deployment, relay bool, start func() (*process, error)) error {
	if !relay {
		if err := b.primeWith(ctx, d, decoder.OutboxDDL, start); err != nil {
			return fmt.Errorf("prime: %w", err)
		}
		return nil
	}
	if err := b.srv.createDatabase(ctx, d.db, relayDDL); err != nil {
		return err
	}
	return b.createStream(ctx, d.stream, d.prefix, false)
}

// txInsert commits $3 outbox rows in one transaction, each with payload $2.
const txInsert = `INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload)
SELECT 'order', $1, 'OrderPlaced', $2::jsonb FROM generate_series(1, $3::int)`

// sendTx is a sender that commits rows rows per call from writer w, all
// with the same payload (the same send time).
func (ws sqlWriters) sendTx(rows int) sender {
	return func(ctx context.Context, w int, payload []byte) error {
		if _, err := ws[w].Exec(ctx, txInsert, strconv.Itoa(w), payload, rows); err != nil {
			return fmt.Errorf("insert %d rows from writer %d: %w", rows, w, err)
		}
		return nil
	}
}

// loadAverage is the host's 1-minute load average, or -1.
func loadAverage() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return -1
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return -1
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return -1
	}
	return v
}

// memTotal is the host's memory, from /proc/meminfo ("24.0 GiB"), or "?".
func memTotal() string {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return "?"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "MemTotal:"); ok {
			if kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64); err == nil {
				return fmt.Sprintf("%.1f GiB", float64(kb)/(1<<20))
			}
		}
	}
	return "?"
}

// validateWorkload reports the workload's out-of-range settings.
func (c Config) validateWorkload() []error {
	var errs []error
	if len(c.WorkloadSizes) == 0 || len(c.WorkloadRates) == 0 {
		errs = append(errs, errors.New("--workload-sizes and --workload-rates must each name at least one value"))
	}
	for _, s := range c.WorkloadSizes {
		if s < 64 || s > 512<<10 {
			errs = append(errs, fmt.Errorf("--workload-sizes: %d is not within 64 bytes and 512 KiB (the payload carries its send time; NATS' max_payload is 1 MiB)", s))
		}
	}
	if c.WorkloadMode != "exactly-once" && c.WorkloadMode != "dedup" {
		errs = append(errs, fmt.Errorf("--workload-delivery: %q is not exactly-once or dedup", c.WorkloadMode))
	}
	if c.WorkloadTx < 1 {
		errs = append(errs, errors.New("--workload-tx must be at least 1"))
	}
	for i, r := range c.WorkloadRates {
		if r < c.WorkloadTx {
			errs = append(errs, fmt.Errorf("--workload-rates: %d rows/s is less than one transaction of --workload-tx %d a second", r, c.WorkloadTx))
		}
		if i > 0 && r <= c.WorkloadRates[i-1] {
			errs = append(errs, fmt.Errorf("--workload-rates: %d does not follow %d: give the rates in ascending order", r, c.WorkloadRates[i-1]))
		}
	}
	if c.WorkloadStep < time.Second {
		errs = append(errs, errors.New("--workload-step must be at least 1s"))
	}
	return errs
}

// workloadFailed reports whether a workload run failed or its output was wrong.
func (r *Report) workloadFailed() bool {
	for _, w := range r.Workload {
		if w.Err != nil || w.Check != nil {
			return true
		}
	}
	return false
}

// printWorkload writes the workload's tables: every step, then per row size
// the sustained rates side by side.
func (r *Report) printWorkload(w io.Writer) {
	c := r.cfg
	fmt.Fprintf(w, "Workload (the shape of Sequin's published CDC benchmark): outbox rows committed in transactions of %d by %d writers, "+
		"rates stepped through %s rows/s, %s each, until one is not sustained (kept ≥ 95%%, p99 to the consumer < %s). Latency: INSERT issued → stored in the stream (the stream's timestamp), and → a consumer.\n\n",
		c.WorkloadTx, c.Writers, joinInts(c.WorkloadRates), c.WorkloadStep, millis(maxSustainedP99))
	fmt.Fprintln(w, "| forwarder | row (payload) | ops/s offered | achieved | payload MB/s | → stored: mean / p50 / p99 / p99.9 | → consumer: p50 / p99 | CPU % forwarder / Postgres / NATS / bench | max WAL unsent by jetbox's walsender | load avg (1 min) | samples | sustained |")
	fmt.Fprintln(w, "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|")
	for _, wr := range r.Workload {
		if wr.Err != nil {
			fmt.Fprintf(w, "| %s | %d B | | | | | | | | | | %s |\n", wr.Forwarder, wr.Size, check(wr.Err))
		}
		for i, s := range wr.Steps {
			kept := "yes"
			if !s.sustains() {
				kept = "**no**"
				if s.Err != nil {
					kept = check(s.Err)
				}
			}
			load := "—"
			if wr.Load[i] >= 0 {
				load = fmt.Sprintf("%.1f", wr.Load[i])
			}
			st := s.Stored
			fmt.Fprintf(w, "| %s | %d B | %s | %s | %.2f | %s / %s / %s / %s | %s / %s | %s | %s | %s | %s | %s |\n", wr.Forwarder, wr.Size,
				groupDigits(float64(s.Rate)), groupDigits(s.Achieved), s.Achieved*float64(wr.Size)/1e6,
				millis(st.Mean), millis(st.P50), millis(st.P99), millis(st.P999), millis(s.Stats.P50), millis(s.Stats.P99),
				s.cpuShares(), kibibytes(s.MaxUnsent), load, groupDigits(float64(s.Stats.N)), kept)
		}
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| row (payload) | forwarder | sustained ops/s | payload MB/s | → stored mean / p99 / p99.9 at that rate | stream check |")
	fmt.Fprintln(w, "|--:|---|--:|--:|--:|---|")
	for _, wr := range r.Workload {
		rate, mbps, lat := "none of the rates tried", "—", "—"
		if b := wr.best(); b != nil {
			rate = groupDigits(b.Achieved)
			mbps = fmt.Sprintf("%.2f", b.Achieved*float64(wr.Size)/1e6)
			lat = millis(b.Stored.Mean) + " / " + millis(b.Stored.P99) + " / " + millis(b.Stored.P999)
			if last := wr.Steps[len(wr.Steps)-1]; last.sustains() {
				rate += " (the highest tried)"
			}
		}
		fmt.Fprintf(w, "| %d B | %s | %s | %s | %s | %s |\n", wr.Size, wr.Forwarder, rate, mbps, lat, check(firstErr(wr.Err, wr.Check)))
	}
}

// workloadHeader describes the workload's host and settings.
func (b *bench) workloadHeader() string {
	c := b.cfg
	return fmt.Sprintf("workload: memory %s, load average (1 min) %.1f at the start; row sizes %s B, transactions of %d rows, rates %s rows/s, %s per step",
		memTotal(), loadAverage(), joinInts(c.WorkloadSizes), c.WorkloadTx, joinInts(c.WorkloadRates), c.WorkloadStep)
}
