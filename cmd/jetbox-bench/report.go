package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Failed reports whether a run's output was wrong or a workload failed. The
// fast-ingest batch is for the report only and does not count.
func (r *Report) Failed() bool {
	for _, t := range r.throughputs() {
		if t != r.FastBatch && t.Err != nil {
			return true
		}
	}
	for _, l := range r.latencies() {
		if l.Err != nil {
			return true
		}
	}
	for _, sw := range r.Sweeps {
		if sw.Check != nil {
			return true
		}
	}
	for _, c := range r.Compare {
		if c.Check != nil {
			return true
		}
		for _, l := range c.Reps {
			if l.Err != nil {
				return true
			}
		}
	}
	return r.StartErr != nil || r.ProfileErr != nil || r.CompareErr != nil || r.workloadFailed()
}

func (r *Report) throughputs() []*throughput {
	var out []*throughput
	for _, t := range []*throughput{r.Dedup, r.ExactlyOnce, r.Traced, r.Relay, r.Recv, r.RawID, r.RawHeaders, r.RawGuarded, r.RawStream, r.FastBatch, r.BigTx, r.Profiled, r.ProfiledExactly} {
		if t != nil {
			out = append(out, t)
		}
	}
	for _, s := range r.Scale {
		for _, t := range []*throughput{s.Jetbox, s.Raw} {
			if t != nil {
				out = append(out, t)
			}
		}
	}
	return out
}

func (r *Report) latencies() []latencyRun {
	var out []latencyRun
	for _, sw := range r.Sweeps {
		out = append(out, sw.Runs...)
	}
	for _, l := range []*latencyRun{r.RelaySteady, r.RawSteady} {
		if l != nil {
			out = append(out, *l)
		}
	}
	return out
}

// Print writes the report as markdown.
func (r *Report) Print(w io.Writer) {
	fmt.Fprintln(w, "## jetbox-bench")
	fmt.Fprintln(w)
	for _, h := range r.Header {
		fmt.Fprintln(w, h+"  ")
	}
	fmt.Fprintln(w)
	extrasOnly := len(r.throughputs()) == 0 && len(r.latencies()) == 0 && (len(r.Compare) > 0 || r.CompareErr != nil || len(r.Workload) > 0)
	if !extrasOnly {
		r.printThroughput(w)
		fmt.Fprintln(w)
	}
	if len(r.latencies()) > 0 || len(r.Startups) > 0 || r.StartErr != nil {
		r.printLatency(w)
		fmt.Fprintln(w)
	}
	if !extrasOnly {
		r.printComparisons(w)
	}
	if len(r.Compare) > 0 || r.CompareErr != nil {
		fmt.Fprintln(w)
		r.printCompare(w)
	}
	if len(r.Scale) > 0 {
		fmt.Fprintln(w)
		r.printScale(w)
	}
	if len(r.Workload) > 0 {
		fmt.Fprintln(w)
		r.printWorkload(w)
	}
	if r.ProfilePath != "" {
		fmt.Fprintf(w, "\nCPU profile of jetbox during a catch-up: %s (`go tool pprof -top -cum %s %s`)\n", r.ProfilePath, "<jetbox binary>", r.ProfilePath)
	}
	if r.ProfilePathExactly != "" {
		fmt.Fprintf(w, "\nCPU profile of jetbox during an exactly-once catch-up: %s\n", r.ProfilePathExactly)
	}
	if r.ProfileErr != nil {
		fmt.Fprintf(w, "\nprofile: FAILED: %v\n", r.ProfileErr)
	}
}

func (r *Report) printThroughput(w io.Writer) {
	fmt.Fprintln(w, "| catch-up / publish | events | events/s | elapsed | forwarder CPU s | Postgres CPU s | NATS CPU s | client CPU s | CPU µs/event | peak RSS | check |")
	fmt.Fprintln(w, "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|")
	for _, t := range r.throughputs() {
		name := t.Name
		if t.Note != "" {
			name += " (" + t.Note + ")"
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", name, groupDigits(float64(t.Events)),
			groupDigits(t.rate()), seconds(t.Elapsed), cpuSecs(t.CPU.Forwarder), cpuSecs(t.CPU.Postgres), cpuSecs(t.CPU.NATS),
			cpuSecs(t.CPU.Client), micros(t.cpuPerEvent()), mebibytes(t.RSS), check(t.Err))
	}
}

func (r *Report) printLatency(w io.Writer) {
	fmt.Fprintln(w, "| steady state, INSERT (publish) → consumer | rows/s target | achieved | p50 | p90 | p99 | max | p50 / p99 to stored | CPU % forwarder / Postgres / NATS / bench | max WAL unsent by the walsender | samples | check |")
	fmt.Fprintln(w, "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|")
	for _, l := range r.latencies() {
		s := l.Stats
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %s / %s | %s | %s | %s | %s |\n", l.Name, groupDigits(float64(l.Rate)), groupDigits(l.Achieved),
			millis(s.P50), millis(s.P90), millis(s.P99), millis(s.Max), millis(l.Stored.P50), millis(l.Stored.P99),
			l.cpuShares(), kibibytes(l.MaxUnsent), groupDigits(float64(s.N)), check(l.Err))
	}
	fmt.Fprintln(w)
	r.printFloor(w)
	for _, sw := range r.Sweeps {
		fmt.Fprintf(w, "%s: %s Its stream after every step%s: %s.  \n", sw.Name, r.kneeText(sw), map[bool]string{true: " and start-up", false: ""}[sw == r.Sweeps[0] && len(r.Startups) > 0], check(sw.Check))
	}
	if len(r.Startups) > 0 || r.StartErr != nil {
		fmt.Fprintf(w, "Start-up to first event stored, warm slot (%d starts): %s", len(r.Startups), durations(r.Startups))
		if r.StartErr != nil {
			fmt.Fprintf(w, "; FAILED: %v", r.StartErr)
		}
		fmt.Fprintln(w)
	}
}

// printFloor sets each sweep step beside the latency floor measured on the
// same rows (floor.go), and splits the tail.
func (r *Report) printFloor(w io.Writer) {
	var runs []latencyRun
	for _, sw := range r.Sweeps {
		for _, l := range sw.Runs {
			if l.Floor.N > 0 {
				runs = append(runs, l)
			}
		}
	}
	if len(runs) == 0 {
		return
	}
	fmt.Fprintln(w, "| same rows: floor (INSERT → XLogData at a bare pglogrepl client) vs jetbox (INSERT → consumer) | rows/s | floor p50 / p99 | jetbox p50 / p99 | jetbox − floor, row by row: p50 / p99 / max | jetbox p99 ≤ floor p99 + 1 ms | rows above jetbox's p99: within 1 ms of their floor | their mean time to the floor / floor → stored / stored → consumer |")
	fmt.Fprintln(w, "|---|--:|--:|--:|--:|---|--:|--:|")
	for _, l := range runs {
		within := "yes"
		if l.Stats.P99 > l.Floor.P99+time.Millisecond {
			within = "**no**"
		}
		t := l.Tail
		fmt.Fprintf(w, "| %s | %s | %s / %s | %s / %s | %s / %s / %s | %s | %d of %d | %s / %s / %s |\n", l.Name, groupDigits(float64(l.Rate)),
			millis(l.Floor.P50), millis(l.Floor.P99), millis(l.Stats.P50), millis(l.Stats.P99),
			signedMillis(l.Beyond.P50), signedMillis(l.Beyond.P99), signedMillis(l.Beyond.Max), within, t.Upstream, t.N,
			millis(t.ToFloor), signedMillis(t.ToStored), signedMillis(t.ToConsumer))
	}
	fmt.Fprintln(w)
	var traced []latencyRun
	for _, l := range runs {
		if l.Own.N > 0 {
			traced = append(traced, l)
		}
	}
	if len(traced) == 0 {
		return
	}
	fmt.Fprintln(w, "| traced (--trace: jetbox's publish span of each row) | rows/s | rows traced | floor → jetbox read the row: p50 / p99 / max | of which jetbox's walsender sent it after the floor's: p50 / p99 | and it waited in the socket and jetbox's buffer: p50 / p99 | jetbox read → stored (jetbox + NATS): p50 / p99 / max | rows above jetbox's p99: mean to the floor / floor → jetbox read (in the socket) / jetbox → stored / stored → consumer |")
	fmt.Fprintln(w, "|---|--:|--:|--:|--:|--:|--:|--:|")
	for _, l := range traced {
		t := l.Tail
		fmt.Fprintf(w, "| %s | %s | %s | %s / %s / %s | %s / %s | %s / %s | %s / %s / %s | %s / %s (%s) / %s / %s (%d of %d traced) |\n", l.Name, groupDigits(float64(l.Rate)), groupDigits(float64(l.Own.N)),
			signedMillis(l.Behind.P50), signedMillis(l.Behind.P99), signedMillis(l.Behind.Max), signedMillis(l.Sent.P50), signedMillis(l.Sent.P99),
			signedMillis(l.Read.P50), signedMillis(l.Read.P99), signedMillis(l.Own.P50), signedMillis(l.Own.P99), signedMillis(l.Own.Max),
			millis(t.ToFloor), signedMillis(t.ToReceived), signedMillis(t.ToRead), signedMillis(t.ToOwn), signedMillis(t.ToConsumer), t.Traced, t.N)
	}
	fmt.Fprintln(w)
}

// cpuShares is the step's CPU use as percentages of one core.
func (l latencyRun) cpuShares() string {
	pct := func(c time.Duration) string {
		if c < 0 || l.Wall <= 0 {
			return "—"
		}
		return fmt.Sprintf("%.0f", 100*c.Seconds()/l.Wall.Seconds())
	}
	return pct(l.CPU.Forwarder) + " / " + pct(l.CPU.Postgres) + " / " + pct(l.CPU.NATS) + " / " + pct(l.CPU.Client)
}

// kneeText says up to which rate jetbox's latency stayed flat and which rate
// it sustained.
func (r *Report) kneeText(sw *sweep) string {
	limit := millis(r.cfg.KneeP99)
	var s string
	if sw.Knee > 0 {
		s = fmt.Sprintf("knee: latency flat (rate kept, p99 ≤ %s) up to %s rows/s", limit, groupDigits(float64(sw.Knee)))
	} else {
		s = fmt.Sprintf("knee: latency not flat even at %s rows/s (p99 above %s)", groupDigits(float64(sw.Runs[0].Rate)), limit)
	}
	if sw.Sustained > 0 {
		s += fmt.Sprintf("; rate sustained (kept, p99 < %s: no growing backlog) up to %s rows/s", millis(maxSustainedP99), groupDigits(float64(sw.Sustained)))
	}
	if last := sw.Runs[len(sw.Runs)-1]; last.sustains() {
		s += ", the highest rate tried"
	}
	return s + "."
}

// comparison is one line of the comparisons table: a ratio of two runs of
// this report, measured, not graded (the goals are prose in
// docs/performance.md).
type comparison struct {
	what, measured string
}

func (r *Report) printComparisons(w io.Writer) {
	fmt.Fprintln(w, "| comparison | measured |")
	fmt.Fprintln(w, "|---|--:|")
	for _, c := range r.comparisons() {
		fmt.Fprintf(w, "| %s | %s |\n", c.what, c.measured)
	}
}

// comparisons sets runs of the report side by side; "—" where one of them
// failed or was skipped.
func (r *Report) comparisons() []comparison {
	var out []comparison
	add := func(what string, ok bool, measured func() string) {
		c := comparison{what, "—"}
		if ok {
			c.measured = measured()
		}
		out = append(out, c)
	}
	ratio := func(what string, a, b *throughput) {
		add(what, a.rate() > 0 && b.rate() > 0, func() string {
			return fmt.Sprintf("%.2f× (%s vs %s events/s)", a.rate()/b.rate(), groupDigits(a.rate()), groupDigits(b.rate()))
		})
	}
	ratio("catch-up: jetbox vs the polling relay", r.Dedup, r.Relay)
	ratio("catch-up: jetbox vs pg_recvlogical", r.Dedup, r.Recv)
	ratio("catch-up: --delivery=exactly-once vs dedup", r.ExactlyOnce, r.Dedup)
	ratio("catch-up: jetbox (exactly-once) vs publishing the same messages alone (its NATS-side ceiling)", r.ExactlyOnce, r.RawGuarded)
	add("fast-ingest batch vs async publish (rate; server + client CPU)", r.FastBatch.rate() > 0 && r.RawID.rate() > 0, func() string {
		return fmt.Sprintf("%.2f×; %s vs %s s", r.FastBatch.rate()/r.RawID.rate(), cpuSecs(r.FastBatch.CPU.NATS+r.FastBatch.CPU.Client),
			cpuSecs(r.RawID.CPU.NATS+r.RawID.CPU.Client))
	})
	ok := func(t *throughput) bool { return t != nil && t.Err == nil && t.Events > 0 }
	add("jetbox CPU per 100,000 events (catch-up)", ok(r.Dedup), func() string {
		return cpuSecs(r.Dedup.CPU.Forwarder*100_000/time.Duration(r.Dedup.Events)) + " s"
	})
	add("CPU per event, Postgres + NATS + forwarder: jetbox vs the polling relay", ok(r.Dedup) && ok(r.Relay), func() string {
		return fmt.Sprintf("%s vs %s µs", micros(r.Dedup.cpuPerEvent()), micros(r.Relay.cpuPerEvent()))
	})
	return out
}

func check(err error) string {
	if err == nil {
		return "ok"
	}
	return "**FAILED**: " + strings.ReplaceAll(strings.ReplaceAll(err.Error(), "\n", " "), "|", "/")
}

// groupDigits formats v rounded, with thousands separators: 84,123.
func groupDigits(v float64) string {
	s := strconv.FormatInt(int64(math.Round(v)), 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	if neg {
		s = "-" + s
	}
	return s
}

func seconds(d time.Duration) string {
	if d <= 0 {
		return "—"
	}
	return fmt.Sprintf("%.2f s", d.Seconds())
}

func cpuSecs(d time.Duration) string {
	if d < 0 {
		return "—"
	}
	return fmt.Sprintf("%.2f", d.Seconds())
}

func micros(d time.Duration) string {
	if d <= 0 {
		return "—"
	}
	return fmt.Sprintf("%.1f", float64(d)/float64(time.Microsecond))
}

func millis(d time.Duration) string {
	if d <= 0 {
		return "—"
	}
	return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond))
}

// signedMillis is millis for a difference, which may be negative or zero.
func signedMillis(d time.Duration) string {
	return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond))
}

func kibibytes(b int64) string {
	if b < 0 {
		return "—"
	}
	return fmt.Sprintf("%s KiB", groupDigits(float64(b)/1024))
}

func mebibytes(b int64) string {
	if b <= 0 {
		return "—"
	}
	return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
}

// durations lists ds as "median x, worst y".
func durations(ds []time.Duration) string {
	if len(ds) == 0 {
		return "—"
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return fmt.Sprintf("median %s, worst %s", millis(s[len(s)/2]), millis(s[len(s)-1]))
}
