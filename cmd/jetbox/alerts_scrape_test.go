package main

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jetbox-dev/jetbox/internal/testenv"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/model/value"
	"github.com/prometheus/prometheus/promql"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/storage"
	"github.com/prometheus/prometheus/tsdb/chunks"
)

// timeline is what a Prometheus server scraping jetbox once a minute would
// hold: each scrape of a running jetbox adds its real /metrics at the next
// minute (with job and instance, and up 1); a target that is gone adds up 0
// and marks its series stale, as Prometheus does. The minutes are
// synthetic, the values are what the binary exported.
type timeline struct {
	t      *testing.T
	minute int
	series map[string]*timelineSeries
}

type timelineSeries struct {
	lbls    labels.Labels
	samples []chunks.Sample
}

func newTimeline(t *testing.T) *timeline {
	return &timeline{t: t, series: map[string]*timelineSeries{}}
}

func (tl *timeline) add(lbls labels.Labels, v float64) {
	k := lbls.String()
	s := tl.series[k]
	if s == nil {
		s = &timelineSeries{lbls: lbls}
		tl.series[k] = s
	}
	s.samples = append(s.samples, floatSample{t: int64(tl.minute) * time.Minute.Milliseconds(), f: v})
}

// scrapeMetrics reads addr's /metrics into samples by label set.
func scrapeMetrics(t *testing.T, addr string) (map[string]float64, map[string]labels.Labels, error) {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, nil, err
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(string(body)))
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	vals, lbls := map[string]float64{}, map[string]labels.Labels{}
	put := func(name string, m *dto.Metric, v float64, extra ...string) {
		b := labels.NewBuilder(labels.EmptyLabels()).Set(labels.MetricName, name)
		for _, lp := range m.GetLabel() {
			b.Set(lp.GetName(), lp.GetValue())
		}
		for i := 0; i+1 < len(extra); i += 2 {
			b.Set(extra[i], extra[i+1])
		}
		l := b.Labels()
		vals[l.String()], lbls[l.String()] = v, l
	}
	for name, f := range fams {
		for _, m := range f.GetMetric() {
			switch f.GetType() {
			case dto.MetricType_COUNTER:
				put(name, m, m.GetCounter().GetValue())
			case dto.MetricType_GAUGE:
				put(name, m, m.GetGauge().GetValue())
			case dto.MetricType_UNTYPED:
				put(name, m, m.GetUntyped().GetValue())
			case dto.MetricType_HISTOGRAM:
				h := m.GetHistogram()
				for _, b := range h.GetBucket() {
					put(name+"_bucket", m, float64(b.GetCumulativeCount()), "le", strconv.FormatFloat(b.GetUpperBound(), 'g', -1, 64))
				}
				put(name+"_bucket", m, float64(h.GetSampleCount()), "le", "+Inf")
				put(name+"_sum", m, h.GetSampleSum())
				put(name+"_count", m, float64(h.GetSampleCount()))
			case dto.MetricType_SUMMARY:
				s := m.GetSummary()
				for _, q := range s.GetQuantile() {
					put(name, m, q.GetValue(), "quantile", strconv.FormatFloat(q.GetQuantile(), 'g', -1, 64))
				}
				put(name+"_sum", m, s.GetSampleSum())
				put(name+"_count", m, float64(s.GetSampleCount()))
			}
		}
	}
	return vals, lbls, nil
}

// scrape adds instance's real /metrics at this minute; it returns the
// samples, or nil when the target did not answer (then up is 0 and its
// series go stale).
func (tl *timeline) scrape(instance, addr string) map[string]float64 {
	vals, lbls, err := scrapeMetrics(tl.t, addr)
	if err != nil {
		tl.add(labels.FromStrings(labels.MetricName, "up", "job", "jetbox", "instance", instance), 0)
		tl.stale(instance)
		return nil
	}
	tl.record(instance, vals, lbls)
	return vals
}

// record adds one successful scrape of instance at this minute.
func (tl *timeline) record(instance string, vals map[string]float64, lbls map[string]labels.Labels) {
	tl.add(labels.FromStrings(labels.MetricName, "up", "job", "jetbox", "instance", instance), 1)
	for k, l := range lbls {
		b := labels.NewBuilder(l).Set("job", "jetbox").Set("instance", instance)
		tl.add(b.Labels(), vals[k])
	}
}

// stale marks instance's series (but up) stale at this minute, once.
func (tl *timeline) stale(instance string) {
	for _, s := range tl.series {
		if s.lbls.Get("instance") != instance || s.lbls.Get(labels.MetricName) == "up" {
			continue
		}
		if last := s.samples[len(s.samples)-1]; !value.IsStaleNaN(last.F()) {
			s.samples = append(s.samples, floatSample{t: int64(tl.minute) * time.Minute.Milliseconds(), f: math.Float64frombits(value.StaleNaN)})
		}
	}
}

func (tl *timeline) tick() { tl.minute++ }

func (tl *timeline) queryable() storage.Queryable {
	var all []storage.Series
	for _, s := range tl.series {
		all = append(all, storage.NewListSeries(s.lbls, s.samples))
	}
	return queryableOf(all)
}

// firing evaluates the alerting rules of rgs over st at end: an alert fires
// when its expression holds at every evaluation (each minute) over its `for`.
func firing(t *testing.T, st storage.Queryable, rgs *rulefmt.RuleGroups, end time.Time) []string {
	t.Helper()
	engine := promql.NewEngine(promql.EngineOpts{MaxSamples: 1e6, Timeout: time.Minute, LookbackDelta: 5 * time.Minute,
		Parser: parser.NewParser(parser.Options{})})
	defer engine.Close()
	var got []string
	for _, g := range rgs.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				continue
			}
			holds := true
			for at := end.Add(-time.Duration(r.For)); !at.After(end) && holds; at = at.Add(time.Minute) {
				q, err := engine.NewInstantQuery(context.Background(), st, nil, r.Expr, at)
				must(t, err)
				res := q.Exec(context.Background())
				if res.Err != nil {
					t.Fatalf("%s: %v", r.Alert, res.Err)
				}
				v, err := res.Vector()
				must(t, err)
				holds = len(v) > 0
				q.Close()
			}
			if holds {
				got = append(got, r.Alert)
			}
		}
	}
	slices.Sort(got)
	return got
}

func minuteTime(m int) time.Time { return time.Unix(0, 0).Add(time.Duration(m) * time.Minute) }

func shippedRules(t *testing.T) *rulefmt.RuleGroups {
	b, err := os.ReadFile(filepath.Join(repoRoot, "deploy/prometheus/alerts.yaml"))
	must(t, err)
	return parseRules(t, "alerts.yaml", b, exportedSeries(t))
}

// goodRow and badRow are outbox rows of permissiveOutbox: a bad one has a
// NULL payload (reason null-payload).
func goodRow(id string) string {
	return fmt.Sprintf(`INSERT INTO outbox VALUES ('%s', 'order', 'o-1', 'Created', '{"ok": true}', NULL)`, id)
}

func badRow(id string) string {
	return fmt.Sprintf(`INSERT INTO outbox VALUES ('%s', 'order', 'o-1', 'Created', NULL, NULL)`, id)
}

// TestAlertRulesOnScrapedSeries evaluates deploy/prometheus/alerts.yaml
// over what running jetbox binaries export, scraped once a (synthetic)
// minute: an active instance and a standby forwarding rows, then a row
// dead-lettered; and a lone instance with --on-invalid=stop that stops on a
// row and is gone. Before the bad row nothing fires; after it
// JetboxInvalidRows does, in both modes: the counters exist at 0 from
// start-up, and a stop waits for the scrape that carries its count
// (--final-scrape-wait). The start-up scrape also holds every series the
// hand-written scenarios of TestAlertRulesFire use, with their labels
// (jetbox_repairs_total's with --on-lost-slot=repair).
func TestAlertRulesOnScrapedSeries(t *testing.T) {
	rgs := shippedRules(t)
	t.Run("dead-letter", func(t *testing.T) {
		f := newFixture(t, withDDL(permissiveOutbox))
		addrA, addrB := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t)), fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
		// --on-lost-slot=repair: jetbox_repairs_total{cause} exists at 0.
		env := []string{"JETBOX_ON_INVALID=dead-letter", "JETBOX_MONITOR_INTERVAL=100ms", autoRepair}
		a := f.start(append(env, "JETBOX_HTTP_ADDR="+addrA)...)
		f.waitStreaming(a)
		b := f.start(append(env, "JETBOX_HTTP_ADDR="+addrB)...)
		testenv.WaitFor(t, 30*time.Second, func() error { // b stands by
			vals, _, err := scrapeMetrics(t, addrB)
			if err != nil {
				return err
			}
			if v := vals[`{__name__="jetbox_state", state="standby"}`]; v != 1 {
				return fmt.Errorf("b's jetbox_state{state=standby} is %v", v)
			}
			return nil
		})
		tl := newTimeline(t)
		checkStartupSeries(t, tl.scrape("a", addrA), true)
		tl.scrape("b", addrB)
		conn := f.conn()
		stored := 0
		row := func(sql string) {
			_, err := conn.Exec(ctxT(t, 10*time.Second), sql)
			must(t, err)
			stored++
			f.waitCount(stored, 30*time.Second)
		}
		for m := 1; m <= 30; m++ {
			tl.tick()
			if m == 25 {
				row(badRow(fmt.Sprintf("bad-%d", m)))
			} else {
				row(goodRow(fmt.Sprintf("good-%d", m)))
			}
			tl.scrape("a", addrA)
			tl.scrape("b", addrB)
			if m == 24 {
				if got := firing(t, tl.queryable(), rgs, minuteTime(m)); len(got) != 0 {
					t.Errorf("minute 24, healthy: firing %v", got)
				}
			}
		}
		got := firing(t, tl.queryable(), rgs, minuteTime(30))
		if !slices.Equal(got, []string{"JetboxInvalidRows"}) {
			t.Errorf("minute 30, after a dead letter: firing %v, want [JetboxInvalidRows]", got)
		}
		a.stop()
		b.stop()
	})
	t.Run("stop", func(t *testing.T) {
		f := newFixture(t, withDDL(permissiveOutbox))
		addr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
		p := f.start("JETBOX_HTTP_ADDR="+addr, "JETBOX_FINAL_SCRAPE_WAIT=1m")
		f.waitStreaming(p)
		tl := newTimeline(t)
		checkStartupSeries(t, tl.scrape("a", addr), false)
		conn := f.conn()
		for m := 1; m <= 20; m++ {
			tl.tick()
			_, err := conn.Exec(ctxT(t, 10*time.Second), goodRow(fmt.Sprintf("good-%d", m)))
			must(t, err)
			f.waitCount(m, 30*time.Second)
			tl.scrape("a", addr)
		}
		_, err := conn.Exec(ctxT(t, 10*time.Second), badRow("bad-1"))
		must(t, err)
		// jetbox stops on the row and waits for a scrape: the scrape that
		// has the count is the one Prometheus would record at minute 21.
		key := fmt.Sprintf(`{__name__="jetbox_invalid_rows_total", action="stop", reason=%q}`, format.ReasonNullPayload)
		tl.tick()
		testenv.WaitFor(t, 30*time.Second, func() error {
			vals, lbls, err := scrapeMetrics(t, addr)
			if err != nil {
				return err
			}
			if vals[key] != 1 {
				return fmt.Errorf("%s is %v", key, vals[key])
			}
			tl.record("a", vals, lbls)
			return nil
		})
		if code := p.wait(30 * time.Second); code != exitFailure {
			t.Fatalf("exit %d after the scrape, want %d:\n%s", code, exitFailure, p.tail(2048))
		}
		if !strings.Contains(p.logText(), `"scraped":true`) {
			t.Errorf("jetbox did not log that its stop was scraped:\n%s", p.tail(2048))
		}
		for m := 22; m <= 25; m++ {
			tl.tick()
			if tl.scrape("a", addr) != nil {
				t.Fatal("jetbox still answers after its exit")
			}
		}
		got := firing(t, tl.queryable(), rgs, minuteTime(25))
		if want := []string{"JetboxAllDown", "JetboxInvalidRows"}; !slices.Equal(got, want) {
			t.Errorf("minute 25, stopped on a row 4 minutes ago: firing %v, want %v", got, want)
		}
	})
}

// checkStartupSeries: a jetbox that has just started exports the series
// the rules and the hand-written scenarios rely on, at 0 where they count.
func checkStartupSeries(t *testing.T, vals map[string]float64, scenarios bool) {
	t.Helper()
	if vals == nil {
		t.Fatal("no scrape")
	}
	want := []string{`{__name__="jetbox_events_published_total"}`, `{__name__="jetbox_publish_errors_total"}`,
		`{__name__="jetbox_replication_lag_bytes"}`, `{__name__="jetbox_slot_retained_wal_over_threshold"}`,
		`{__name__="jetbox_seconds_since_last_ack"}`, `{__name__="jetbox_reconnects_total", side="nats"}`,
		`{__name__="jetbox_end_to_end_latency_seconds_bucket", le="+Inf"}`}
	for _, st := range allStatesForTest {
		want = append(want, fmt.Sprintf(`{__name__="jetbox_state", state=%q}`, st))
	}
	for _, r := range format.Reasons() {
		want = append(want, fmt.Sprintf(`{__name__="jetbox_invalid_rows_total", action="stop", reason=%q}`, r))
	}
	var missing []string
	for _, k := range want {
		if _, ok := vals[k]; !ok {
			missing = append(missing, k)
		}
	}
	build := 0
	for k, v := range vals {
		if strings.HasPrefix(k, `{__name__="jetbox_build_info"`) && strings.Contains(k, "goversion=") && strings.Contains(k, "revision=") && v == 1 {
			build++
		}
	}
	if build != 1 {
		missing = append(missing, "jetbox_build_info{version,revision,goversion} 1")
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Errorf("a jetbox just started does not export %q", missing)
	}
	// Every series a hand-written scenario writes exists at start-up (with
	// dead-lettering on, which adds the dead-letter label sets).
	for _, sc := range alertScenarios {
		if !scenarios {
			break
		}
		for _, line := range strings.Split(sc.series, "\n") {
			line = strings.TrimSpace(line)
			if !strings.HasPrefix(line, "jetbox_") {
				continue // STATE lines are checked above, up is Prometheus'
			}
			lbls, _, err := parser.NewParser(parser.Options{}).ParseSeriesDesc(line)
			must(t, err)
			if lbls.Get("standby") != "" {
				continue // per standby of --standby-urls: TestFailoverSlotReady scrapes it
			}
			b := labels.NewBuilder(lbls).Del("job", "instance")
			if _, ok := vals[b.Labels().String()]; !ok && lbls.Get("le") == "" {
				t.Errorf("scenario %q writes %s, which a jetbox just started does not export", sc.name, b.Labels())
			}
		}
	}
}
