package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/nats-io/nats.go/jetstream"
)

// sinkWatermarkBucket is dedup mode's watermark bucket.
const sinkWatermarkBucket = sink.WatermarkBucket

// The compare workload (--baseline-bin, --status-intervals) runs jetbox
// set-ups side by side in one run: each a build (the current one, or a
// previous one's binary) with a delivery mode and settings, in steady state
// at --rate for --steady, repetition after repetition, interleaved (the
// order reversed every other repetition, so a drift of the shared machine
// falls on every set-up alike). Each set-up has its own database, slot and
// stream; every repetition has the latency floor beside it, and each
// set-up's stream is checked at the end (every row once, in commit order).
// The report gives each set-up's median p50 and p99 over the repetitions,
// and their ratio to the set-up it is compared with.

// variant is one set-up the compare workload runs.
type variant struct {
	Name     string
	Bin      string   // the jetbox binary
	Delivery string   // --delivery
	Env      []string // extra JETBOX_* settings
	Ref      int      // index of the variant it is compared with; -1: none (it is a reference)
	// FloorQuiet: the floor client beside it reports its write position
	// only, never confirming (--floor-confirm=both).
	FloorQuiet bool
	// Bare: the bare forwarder (bare.go) instead of jetbox; Bin is unused.
	// BareGuard: with exactly-once's expected-sequence and -id headers.
	Bare, BareGuard bool
}

// bareVariants are the bare forwarder's set-ups (--compare-bare), without
// and with exactly-once's guards; their streams are created as jetbox
// creates an exactly-once one.
var bareVariants = []variant{
	{Name: "bare forwarder (pglogrepl → async publish, no jetbox)", Delivery: "exactly-once", Ref: -1, Bare: true},
	{Name: "bare forwarder, with exactly-once's expected last sequence and id", Delivery: "exactly-once", Ref: -1, Bare: true, BareGuard: true},
}

// compareRun is what one variant measured, repetition by repetition.
type compareRun struct {
	variant
	Reps  []latencyRun
	Waits []waitCounts // the walsenders' wait events, per repetition
	// KVStores: messages the watermark bucket's stream took during each
	// repetition (dedup mode's watermark stores, every jetbox's), -1
	// where it could not be read.
	KVStores []int64
	Check    error // the stream at the end: every row once, in commit order
}

// compareVariants lists the set-ups: per delivery mode, the baseline build
// (if any), the current build, and the current build at each status
// interval; each is compared with the first of its mode.
func (c Config) compareVariants(current string) []variant {
	var out []variant
	for _, mode := range c.CompareDelivery {
		ref := -1
		add := func(v variant) {
			v.Ref = ref
			if ref < 0 {
				ref = len(out)
			}
			out = append(out, v)
		}
		for _, bin := range c.BaselineBins {
			add(variant{Name: fmt.Sprintf("baseline %s, --delivery=%s", filepath.Base(bin), mode), Bin: bin, Delivery: mode})
		}
		if len(c.BaselineBins) > 0 || len(c.StatusIntervals) == 0 {
			add(variant{Name: "current, --delivery=" + mode, Bin: current, Delivery: mode})
		}
		for _, si := range c.StatusIntervals {
			add(variant{Name: fmt.Sprintf("current, --delivery=%s --status-interval=%s", mode, si),
				Bin: current, Delivery: mode, Env: []string{"JETBOX_STATUS_INTERVAL=" + si.String()}})
		}
	}
	if c.CompareBare {
		out = append(out, bareVariants...)
	}
	if !c.FloorBoth {
		return out
	}
	both := make([]variant, 0, 2*len(out))
	for _, v := range out {
		q := v
		q.Name, q.FloorQuiet, q.Ref = v.Name+" (floor not confirming)", true, len(both)
		v.Ref = -1
		both = append(both, v, q)
	}
	return both
}

// checkBaseline makes sure a previous build reads every setting the bench
// gives it: an older jetbox ignores an environment variable it does not
// know, which would measure something else without a word.
func (b *bench) checkBaseline(vs []variant) error {
	var problems []string
	help := map[string]string{}
	for _, v := range vs {
		if v.Bin == b.jetbox || v.Bare {
			continue
		}
		if _, ok := help[v.Bin]; !ok {
			out, err := runOutput(v.Bin, "run", "--help")
			if err != nil {
				return fmt.Errorf("--baseline-bin %s: `run --help` failed (%w): is it a jetbox binary?", v.Bin, err)
			}
			help[v.Bin] = out
		}
		for _, kv := range append(b.jetboxEnv(newDeployment("x", v.Delivery)), v.Env...) {
			key, _, _ := strings.Cut(kv, "=")
			if !strings.Contains(help[v.Bin], key) {
				problems = append(problems, v.Bin+" does not read "+key)
			}
		}
	}
	if len(problems) > 0 {
		slices.Sort(problems)
		return fmt.Errorf("--baseline-bin: %s (the bench sets these): build a baseline that has these settings, or leave out the option that needs them",
			strings.Join(slices.Compact(problems), ", "))
	}
	return nil
}

// compare runs the compare workload.
func (b *bench) compare(ctx context.Context) ([]*compareRun, error) {
	vs := b.cfg.compareVariants(b.jetbox)
	if err := b.checkBaseline(vs); err != nil {
		return nil, err
	}
	runs := make([]*compareRun, len(vs))
	deps := make([]deployment, len(vs))
	writers := make([]sqlWriters, len(vs))
	defer func() {
		for _, ws := range writers {
			ws.close()
		}
	}()
	for i, v := range vs {
		runs[i] = &compareRun{variant: v}
		deps[i] = newDeployment(fmt.Sprintf("cmp%d", i), v.Delivery)
		start := b.variantStart(v, deps[i])
		if v.Bare { // jetbox creates the slot, the publication and the stream
			start = b.variantStart(variant{Bin: b.jetbox, Delivery: v.Delivery}, deps[i])
		}
		if err := b.primeWith(ctx, deps[i], decoder.OutboxDDL, start); err != nil {
			return runs, fmt.Errorf("%s: prime: %w", v.Name, err)
		}
		ws, err := b.openWriters(ctx, deps[i].db)
		if err != nil {
			return runs, err
		}
		writers[i] = ws
	}
	for rep := range b.cfg.Reps {
		order := make([]int, len(vs))
		for i := range order {
			order[i] = i
		}
		if rep%2 == 1 {
			slices.Reverse(order)
		}
		for _, i := range order {
			if ctx.Err() != nil {
				return runs, ctx.Err()
			}
			kv0 := b.kvStores(ctx)
			run, waits := b.compareRep(ctx, vs[i], deps[i], writers[i], rep)
			stores := int64(-1)
			if kv1 := b.kvStores(ctx); kv0 >= 0 && kv1 >= 0 {
				stores = kv1 - kv0
			}
			runs[i].Reps = append(runs[i].Reps, run)
			runs[i].Waits = append(runs[i].Waits, waits)
			runs[i].KVStores = append(runs[i].KVStores, stores)
		}
	}
	for i := range vs {
		runs[i].Check = b.verify(ctx, deps[i].db, deps[i].stream, true)
	}
	return runs, nil
}

// kvStores is the watermark bucket's stream's last sequence: how many
// watermark stores it took so far (0 before the bucket exists, -1 when it
// cannot be read).
func (b *bench) kvStores(ctx context.Context) int64 {
	s, err := b.srv.js.Stream(ctx, "KV_"+sinkWatermarkBucket)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return 0
	}
	if err != nil {
		return -1
	}
	info, err := s.Info(ctx)
	if err != nil {
		return -1
	}
	return int64(info.State.LastSeq)
}

// variantStart starts v's jetbox (or the bare forwarder) for d.
func (b *bench) variantStart(v variant, d deployment) func() (*process, error) {
	return func() (*process, error) {
		if v.Bare {
			return b.startBare(d, v.BareGuard)
		}
		return startProcess("jetbox", b.logPath("jetbox-"+d.db), append(b.jetboxEnv(d), v.Env...), v.Bin, "run")
	}
}

// compareRep is one repetition of v: start, warm up, one steady step with
// the floor and the wait-event sampler beside it, stop.
func (b *bench) compareRep(ctx context.Context, v variant, d deployment, ws sqlWriters, rep int) (latencyRun, waitCounts) {
	name := fmt.Sprintf("%s (rep %d)", v.Name, rep+1)
	b.floorConfirm = !v.FloorQuiet
	defer func() { b.floorConfirm = b.cfg.FloorConfirm }()
	load, stop, err := b.startSQLLoad(ctx, d, ws, b.variantStart(v, d), loadOpts{streams: true, floor: true})
	if err != nil {
		return latencyRun{Name: name, Rate: b.cfg.SteadyRate, Err: err}, nil
	}
	defer load.consumer.stop()
	load.slot = d.slot
	waits := b.sampleWaits(ctx, d.slot, load.floor.slot)
	run := load.step(ctx, name, b.cfg.SteadyRate, b.cfg.Steady)
	counts := waits.finish()
	load.floor.stop()
	if err := stop(); err != nil && run.Err == nil {
		run.Err = err
	}
	return run, counts
}

// medianOf returns the median of f over the repetitions without an error
// (the mean of the middle two for an even count); 0 for none.
func medianOf(reps []latencyRun, f func(latencyRun) time.Duration) time.Duration {
	var ds []time.Duration
	for _, r := range reps {
		if r.Err == nil {
			ds = append(ds, f(r))
		}
	}
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	if n := len(ds); n%2 == 0 {
		return (ds[n/2-1] + ds[n/2]) / 2
	}
	return ds[len(ds)/2]
}

// printCompare writes the compare workload's table: per set-up, each
// repetition's p50/p99, their medians, the floor's, and the ratios to the
// set-up it is compared with; then the walsenders' wait events.
func (r *Report) printCompare(w io.Writer) {
	c := r.cfg
	fmt.Fprintf(w, "### Compared set-ups: %s at %d rows/s in 1-row transactions, %d interleaved repetitions each (median)\n\n",
		c.Steady, c.SteadyRate, c.Reps)
	if r.CompareErr != nil {
		fmt.Fprintf(w, "Did not complete: %v\n\n", r.CompareErr)
	}
	fmt.Fprintln(w, "| set-up | p50 per rep (ms) | p99 per rep (ms) | p50 | p99 | floor p99 | p99 − floor p99 | to stored: p99 − floor p99 | row by row, forwarder − floor: p50 / p99 | p50 ratio | p99 ratio | CPU µs/row forwarder / NATS | watermark stores per 1,000 rows | check |")
	fmt.Fprintln(w, "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|")
	p50 := func(l latencyRun) time.Duration { return l.Stats.P50 }
	p99 := func(l latencyRun) time.Duration { return l.Stats.P99 }
	floor99 := func(l latencyRun) time.Duration { return l.Floor.P99 }
	for _, cr := range r.Compare {
		var reps50, reps99 []string
		var errs []error
		for _, l := range cr.Reps {
			reps50, reps99 = append(reps50, msNumber(l.Stats.P50)), append(reps99, msNumber(l.Stats.P99))
			if l.Err != nil {
				errs = append(errs, l.Err)
			}
		}
		ratio50, ratio99 := "", ""
		if cr.Ref >= 0 && cr.Ref < len(r.Compare) {
			ref := r.Compare[cr.Ref]
			ratio50 = ratio(medianOf(cr.Reps, p50), medianOf(ref.Reps, p50))
			ratio99 = ratio(medianOf(cr.Reps, p99), medianOf(ref.Reps, p99))
		}
		m99, f99 := medianOf(cr.Reps, p99), medianOf(cr.Reps, floor99)
		// Stored in the stream (the server's timestamp): where the forwarder's
		// part ends, before the NATS server delivers the row to the consumer.
		s99 := medianOf(cr.Reps, func(l latencyRun) time.Duration { return l.Stored.P99 })
		perRow := func(f func(usage) time.Duration) func(latencyRun) time.Duration {
			return func(l latencyRun) time.Duration {
				if l.Stats.N == 0 {
					return 0
				}
				return f(l.CPU) / time.Duration(l.Stats.N)
			}
		}
		cpuJ := medianOf(cr.Reps, perRow(func(u usage) time.Duration { return u.Forwarder }))
		cpuN := medianOf(cr.Reps, perRow(func(u usage) time.Duration { return u.NATS }))
		var kv []string
		for i, n := range cr.KVStores {
			if n >= 0 && i < len(cr.Reps) && cr.Reps[i].Stats.N > 0 {
				kv = append(kv, fmt.Sprintf("%.0f", 1000*float64(n)/float64(cr.Reps[i].Stats.N)))
			}
		}
		beyond50 := medianOf(cr.Reps, func(l latencyRun) time.Duration { return l.Beyond.P50 })
		beyond99 := medianOf(cr.Reps, func(l latencyRun) time.Duration { return l.Beyond.P99 })
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %s | %s / %s | %s | %s | %s / %s | %s | %s |\n", cr.Name, strings.Join(reps50, ", "), strings.Join(reps99, ", "),
			millis(medianOf(cr.Reps, p50)), millis(m99), millis(f99), signedMillis(m99-f99), signedMillis(s99-f99), millis(beyond50), millis(beyond99), ratio50, ratio99,
			micros(cpuJ), micros(cpuN), strings.Join(kv, ", "), check(errors.Join(append(errs, cr.Check)...)))
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "Walsender wait events (samples every %s, all repetitions):\n\n", waitSampleEvery)
	for _, cr := range r.Compare {
		sum := waitCounts{}
		for _, wc := range cr.Waits {
			for k, n := range wc {
				sum[k] += n
			}
		}
		fmt.Fprintf(w, "- %s: %s\n", cr.Name, sum)
	}
}

// ratio is a/b to two decimals ("" when b is zero).
func ratio(a, b time.Duration) string {
	if b <= 0 {
		return ""
	}
	return fmt.Sprintf("%.2f", float64(a)/float64(b))
}

// msNumber is d in milliseconds, two decimals, without the unit.
func msNumber(d time.Duration) string {
	return fmt.Sprintf("%.2f", float64(d)/float64(time.Millisecond))
}
