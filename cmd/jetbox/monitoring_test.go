package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/histogram"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/storage"
	"github.com/prometheus/prometheus/tsdb/chunkenc"
	"github.com/prometheus/prometheus/tsdb/chunks"
	"github.com/prometheus/prometheus/util/annotations"
	"go.yaml.in/yaml/v3"
)

// series is what jetbox exports: every series name a query may select, with
// the labels jetbox itself puts on it.
type series map[string][]string

// exportedSeries reads jetbox's registry: the names from each collector's
// descriptions (a vector with no child yet, such as jetbox_invalid_rows_total,
// is described but not gathered), and the histogram and summary suffixes from
// what it gathers.
func exportedSeries(t *testing.T) series {
	t.Helper()
	m := metrics.New()
	out := series{}
	desc := regexp.MustCompile(`^Desc\{fqName: "([^"]+)".*variableLabels: \{([^}]*)\}\}$`)
	var collectors []prometheus.Collector
	for _, c := range []prometheus.Collector{m.Published, m.Duplicates, m.PublishErrors, m.Retries, m.InFlight, m.ConfirmedLSN,
		m.ServerLSN, m.LagBytes, m.RetainedWAL, m.RetainedOver, m.Latency, m.Transactions, m.Reconnects, m.Heartbeats, m.State, m.InvalidRows, m.FailoverSlotReady, m.Repairs} {
		collectors = append(collectors, c)
	}
	ch := make(chan *prometheus.Desc, 1024)
	for _, c := range collectors {
		c.Describe(ch)
	}
	close(ch)
	for d := range ch {
		sm := desc.FindStringSubmatch(d.String())
		if sm == nil {
			t.Fatalf("cannot read %s", d)
		}
		var lbls []string
		if sm[2] != "" {
			lbls = strings.Split(sm[2], ",")
		}
		out[sm[1]] = lbls
	}
	fams, err := m.Registry.Gather()
	must(t, err)
	for _, f := range fams {
		name := f.GetName()
		var lbls []string
		if len(f.GetMetric()) > 0 {
			for _, lp := range f.GetMetric()[0].GetLabel() {
				lbls = append(lbls, lp.GetName())
			}
		}
		if _, ok := out[name]; !ok {
			out[name] = lbls // the Go and process collectors
		}
		switch f.GetType() {
		case dto.MetricType_HISTOGRAM, dto.MetricType_GAUGE_HISTOGRAM:
			out[name+"_bucket"] = append(slices.Clone(out[name]), "le")
			out[name+"_sum"], out[name+"_count"] = out[name], out[name]
			delete(out, name) // a classic histogram has no series of its own name
		case dto.MetricType_SUMMARY:
			out[name+"_sum"], out[name+"_count"] = out[name], out[name]
			out[name] = append(slices.Clone(out[name]), "quantile")
		}
	}
	// The histogram every rule and panel uses must be known with its suffixes
	// even if Gather changed: it has no labels, so it is always gathered.
	if _, ok := out["jetbox_end_to_end_latency_seconds_bucket"]; !ok {
		t.Fatal("registry: no jetbox_end_to_end_latency_seconds_bucket")
	}
	return out
}

// targetLabels are the labels Prometheus attaches to every scraped series
// (job, instance) or Kubernetes service discovery and the Prometheus
// Operator do (namespace, pod, service, container, endpoint).
var targetLabels = []string{"job", "instance", "namespace", "pod", "service", "container", "endpoint"}

// prometheusSeries are series Prometheus itself makes for each target.
var prometheusSeries = map[string]bool{"up": true}

// errorReporter is the part of *testing.T checkQuery reports to.
type errorReporter interface {
	Errorf(format string, args ...any)
}

// recorder records what checkQuery reports, for the tests of the checks.
type recorder struct{ errs []string }

func (r *recorder) Errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

// checkQuery parses expr with Prometheus' PromQL parser and checks each
// series it selects: the name is one jetbox exports, and every label it
// matches on is one the series has, with a value jetbox can give it.
func checkQuery(t errorReporter, where, expr string, known series) (names []string) {
	e, err := parser.NewParser(parser.Options{}).ParseExpr(expr)
	if err != nil {
		t.Errorf("%s: %q: %v", where, expr, err)
		return nil
	}
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		name := vs.Name
		for _, m := range vs.LabelMatchers {
			if m.Name == labels.MetricName {
				name = m.Value
			}
		}
		names = append(names, name)
		lbls, ok := known[name]
		if !ok && !prometheusSeries[name] {
			t.Errorf("%s: %q selects %q, which jetbox does not export", where, expr, name)
			return nil
		}
		for _, m := range vs.LabelMatchers {
			if m.Name == labels.MetricName {
				continue
			}
			if !slices.Contains(lbls, m.Name) && !slices.Contains(targetLabels, m.Name) {
				t.Errorf("%s: %q matches label %q on %s, which has labels %v", where, expr, m.Name, name, lbls)
			}
			if name == "jetbox_state" && m.Name == "state" {
				values := []string{m.Value}
				if m.Type == labels.MatchRegexp || m.Type == labels.MatchNotRegexp {
					values = strings.Split(m.Value, "|")
				}
				for _, v := range values {
					if !slices.Contains(allStatesForTest, v) {
						t.Errorf("%s: %q: jetbox_state has no state %q", where, expr, v)
					}
				}
			}
		}
		return nil
	})
	return names
}

var allStatesForTest = replication.States()

// parseRules parses a rules file with Prometheus' own rule parser (which also
// validates each expression, duration and template) and checks every query.
func parseRules(t *testing.T, where string, content []byte, known series) *rulefmt.RuleGroups {
	t.Helper()
	rgs, errs := rulefmt.Parse(content, false, model.UTF8Validation, parser.NewParser(parser.Options{}), slog.New(slog.DiscardHandler))
	for _, err := range errs {
		t.Errorf("%s: %v", where, err)
	}
	if rgs == nil {
		t.FailNow()
	}
	for _, g := range rgs.Groups {
		for _, r := range g.Rules {
			checkQuery(t, where+": "+r.Alert+r.Record, r.Expr, known)
		}
	}
	return rgs
}

// TestAlertRules: the rule files of deploy/prometheus parse as Prometheus
// rules, name only series jetbox (or, for the database rules, the exporter)
// exports, carry a severity, a summary and a runbook_url that is a section
// of docs/operations.md, and cover the alerts docs/operations.md lists.
func TestAlertRules(t *testing.T) {
	known := withExporterSeries(exportedSeries(t))
	var alerts []string
	for _, rf := range ruleFiles {
		b, err := os.ReadFile(filepath.Join(repoRoot, "deploy/prometheus", rf.file))
		must(t, err)
		rgs := parseRules(t, rf.file, b, known)
		checkRunbooks(t, rf.file, b)
		for _, g := range rgs.Groups {
			for _, r := range g.Rules {
				if r.Alert == "" {
					continue
				}
				if !slices.Contains(alerts, r.Alert) {
					alerts = append(alerts, r.Alert)
				}
				if r.Labels["severity"] == "" || r.Annotations["summary"] == "" {
					t.Errorf("%s: %s: no severity label or summary", rf.file, r.Alert)
				}
			}
		}
	}
	for _, want := range append(slices.Clone(jetboxRules), databaseRules...) {
		if !slices.Contains(alerts, want) {
			t.Errorf("deploy/prometheus lacks %s", want)
		}
	}
	ops, err := os.ReadFile(filepath.Join(repoRoot, "docs/operations.md"))
	must(t, err)
	for _, a := range alerts {
		if !strings.Contains(string(ops), "`"+a+"`") {
			t.Errorf("docs/operations.md does not describe %s", a)
		}
	}
}

// TestCheckQueryCatches: the checks above fail on the mistakes they are for.
func TestCheckQueryCatches(t *testing.T) {
	known := exportedSeries(t)
	for _, expr := range []string{
		`jetbox_replication_lag`,                      // no such metric
		`rate(jetbox_end_to_end_latency_seconds[5m])`, // a histogram is selected by its suffixes
		`jetbox_state{state="active"}`,                // no such state
		`jetbox_invalid_rows_total{kind="x"}`,         // no such label
		`rate(jetbox_events_published_total[5m]`,      // does not parse
	} {
		var r recorder
		checkQuery(&r, "test", expr, known)
		if len(r.errs) == 0 {
			t.Errorf("checkQuery accepts %s", expr)
		}
	}
	for _, expr := range []string{
		`histogram_quantile(0.99, sum by (le) (rate(jetbox_end_to_end_latency_seconds_bucket[5m])))`,
		`jetbox_invalid_rows_total{reason="x", action="stop", namespace="a"}`,
		`go_goroutines + process_resident_memory_bytes`,
		`up{job="jetbox"}`,
	} {
		var r recorder
		checkQuery(&r, "test", expr, known)
		if len(r.errs) > 0 {
			t.Errorf("checkQuery refuses %s: %v", expr, r.errs)
		}
	}
}

// grafanaVars are the dashboard's variables and Grafana's built-in ones,
// replaced by sample values so that each query parses as PromQL.
var grafanaVars = strings.NewReplacer("$__rate_interval", "5m", "$__interval", "1m", "$__range", "1h",
	"${job}", "jetbox", "$job", "jetbox", "${namespace}", "default", "$namespace", "default", "${instance}", ".*", "$instance", ".*")

type grafanaPanel struct {
	Title   string `json:"title"`
	Type    string `json:"type"`
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
	Panels []grafanaPanel `json:"panels"` // rows
}

// TestGrafanaDashboard: deploy/grafana/jetbox.json is a dashboard whose
// queries parse and name only series jetbox exports, with a panel for each
// thing operators watch.
func TestGrafanaDashboard(t *testing.T) {
	known := exportedSeries(t)
	b, err := os.ReadFile(filepath.Join(repoRoot, "deploy/grafana/jetbox.json"))
	must(t, err)
	var d struct {
		UID        string         `json:"uid"`
		Title      string         `json:"title"`
		Panels     []grafanaPanel `json:"panels"`
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Query any    `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	must(t, json.Unmarshal(b, &d))
	if d.UID == "" || d.Title == "" {
		t.Error("dashboard without uid or title")
	}
	used := map[string]bool{}
	var walk func([]grafanaPanel)
	walk = func(ps []grafanaPanel) {
		for _, p := range ps {
			walk(p.Panels)
			if p.Type == "row" {
				continue
			}
			if len(p.Targets) == 0 {
				t.Errorf("panel %q has no query", p.Title)
			}
			for _, tg := range p.Targets {
				if strings.Contains(tg.Expr, "$") && strings.Contains(grafanaVars.Replace(tg.Expr), "$") {
					t.Errorf("panel %q: %q uses a variable the test does not know", p.Title, tg.Expr)
				}
				for _, n := range checkQuery(t, "panel "+p.Title, grafanaVars.Replace(tg.Expr), known) {
					used[n] = true
				}
			}
		}
	}
	walk(d.Panels)
	for _, v := range d.Templating.List {
		if q, ok := v.Query.(map[string]any); ok {
			if s, ok := q["query"].(string); ok {
				if m := regexp.MustCompile(`label_values\(([a-z_]+)`).FindStringSubmatch(s); m != nil {
					if _, ok := known[m[1]]; !ok && !prometheusSeries[m[1]] {
						t.Errorf("variable %s: %q names %q, which jetbox does not export", v.Name, s, m[1])
					}
				}
			}
		}
	}
	// What the dashboard is for: throughput, lag in bytes and time, retained
	// WAL, the in-flight window, publish latency, state, invalid rows.
	for _, want := range []string{"jetbox_events_published_total", "jetbox_replication_lag_bytes", "jetbox_server_wal_lsn",
		"jetbox_slot_retained_wal_bytes", "jetbox_inflight_events", "jetbox_end_to_end_latency_seconds_bucket", "jetbox_state",
		"jetbox_invalid_rows_total", "jetbox_publish_errors_total"} {
		if !used[want] {
			t.Errorf("no panel shows %s", want)
		}
	}
}

// alertScenarios are metric histories (the series notation of Prometheus'
// rule tests, one sample a minute for 30 minutes) and the alerts that must
// fire at their end. "STATE a standby" stands for instance a's jetbox_state
// series as jetbox exports them: 1 for that state, 0 for every other.
var alertScenarios = []struct {
	name   string
	series string
	firing []string
}{
	{"healthy: one streams, one stands by", `
		up{job="jetbox", instance="a"} 1x30
		up{job="jetbox", instance="b"} 1x30
		STATE a streaming
		STATE b standby
		jetbox_replication_lag_bytes{job="jetbox", instance="a"} 1e6+1e6x30
		jetbox_replication_lag_bytes{job="jetbox", instance="b"} 1e6+1e6x30
		jetbox_events_published_total{job="jetbox", instance="a"} 0+100x30
		jetbox_events_published_total{job="jetbox", instance="b"} 0x30
		jetbox_events_duplicate_total{job="jetbox", instance="a"} 0x30
		jetbox_events_duplicate_total{job="jetbox", instance="b"} 0x30
		jetbox_publish_errors_total{job="jetbox", instance="a"} 0x30
		jetbox_publish_errors_total{job="jetbox", instance="b"} 0x30
		jetbox_slot_retained_wal_over_threshold{job="jetbox", instance="a"} 0x30
		jetbox_reconnects_total{job="jetbox", instance="a", side="nats"} 0+0.2x30
		jetbox_seconds_since_last_ack{job="jetbox", instance="a"} 2x30
		jetbox_seconds_since_last_ack{job="jetbox", instance="b"} 0+60x30
		jetbox_audit_missing_rows{job="jetbox", instance="a"} 0x30
		jetbox_audit_missing_rows{job="jetbox", instance="b"} 0x30
		jetbox_audit_complete_until_timestamp_seconds{job="jetbox", instance="a"} 0+60x30
		jetbox_audit_complete_until_timestamp_seconds{job="jetbox", instance="b"} 0x30
	`, nil},
	{"nothing acked for 20 minutes while behind", `
		up{job="jetbox", instance="a"} 1x30
		STATE a streaming
		jetbox_replication_lag_bytes{job="jetbox", instance="a"} 20e6x30
		jetbox_events_published_total{job="jetbox", instance="a"} 0+100x10 1000x20
		jetbox_events_duplicate_total{job="jetbox", instance="a"} 0x30
		jetbox_seconds_since_last_ack{job="jetbox", instance="a"} 1x10 120+60x19
	`, []string{"JetboxNoRecentAck"}},
	{"jetbox down, seen from CloudNativePG", `
		cnpg_pg_replication_slots_pg_wal_lsn_diff{namespace="db", pod="pg-1", slot_name="jetbox", slot_type="logical", database="app"} 1e6x10 1e8+1e8x20
		cnpg_pg_replication_slots_active{namespace="db", pod="pg-1", slot_name="jetbox", slot_type="logical", database="app"} 1x10 0x20
		cnpg_pg_replication_slots_pg_wal_lsn_diff{namespace="db", pod="pg-1", slot_name="other", slot_type="logical", database="app"} 5e9x30
	`, []string{"JetboxAllDown", "JetboxSlotInactive", "JetboxSlotRetainedWAL"}},
	{"jetbox down, seen from postgres_exporter", `
		pg_replication_slot_safe_wal_size_bytes{slot_name="jetbox", slot_type="logical"} 5e9-2e8x30
		pg_replication_slot_slot_is_active{slot_name="jetbox", slot_type="logical"} 0x30
		pg_replication_slot_slot_is_active{slot_name="other", slot_type="logical"} 0x30
	`, []string{"JetboxAllDown", "JetboxSlotInactive", "JetboxSlotRetainedWAL"}},
	{"stalled: lag grows, nothing acked", `
		up{job="jetbox", instance="a"} 1x30
		up{job="jetbox", instance="b"} 1x30
		STATE a streaming
		STATE b standby
		jetbox_replication_lag_bytes{job="jetbox", instance="a"} 0+5e6x30
		jetbox_replication_lag_bytes{job="jetbox", instance="b"} 0+5e6x30
		jetbox_events_published_total{job="jetbox", instance="a"} 500x30
		jetbox_events_duplicate_total{job="jetbox", instance="a"} 7x30
		jetbox_publish_errors_total{job="jetbox", instance="a"} 0x30
	`, []string{"JetboxStalled"}},
	{"publishes fail while a standby waits", `
		up{job="jetbox", instance="a"} 1x30
		up{job="jetbox", instance="b"} 1x30
		STATE a republishing
		STATE b standby
		jetbox_replication_lag_bytes{job="jetbox", instance="a"} 0+1e6x30
		jetbox_events_published_total{job="jetbox", instance="a"} 500x30
		jetbox_events_duplicate_total{job="jetbox", instance="a"} 0x30
		jetbox_publish_errors_total{job="jetbox", instance="a"} 0+10x30
	`, []string{"JetboxPublishFailing", "JetboxStalled", "JetboxNotStreaming"}},
	{"standbys, no active", `
		up{job="jetbox", instance="a"} 1x30
		up{job="jetbox", instance="b"} 1x30
		STATE a standby
		STATE b standby
	`, []string{"JetboxStandbyWithoutActive", "JetboxNotStreaming"}},
	{"retained WAL over the threshold", `
		up{job="jetbox", instance="a"} 1x30
		STATE a streaming
		jetbox_slot_retained_wal_over_threshold{job="jetbox", instance="a"} 0x20 1x10
	`, []string{"JetboxRetainedWAL"}},
	{"an invalid row dead-lettered", `
		up{job="jetbox", instance="a"} 1x30
		STATE a streaming
		jetbox_invalid_rows_total{job="jetbox", instance="a", reason="null-payload", action="dead-letter"} 0x25 1x5
	`, []string{"JetboxInvalidRows"}},
	{"one of two down", `
		up{job="jetbox", instance="a"} 1x30
		up{job="jetbox", instance="b"} 1x20 0x10
		STATE a streaming
	`, []string{"JetboxDown"}},
	{"all down", `
		up{job="jetbox", instance="a"} 1x10 0x20
		up{job="jetbox", instance="b"} 1x10 0x20
	`, []string{"JetboxDown", "JetboxAllDown"}},
	{"not scraped at all", `
		up{job="other", instance="x"} 1x30
	`, []string{"JetboxAllDown"}},
	{"far behind but forwarding", `
		up{job="jetbox", instance="a"} 1x30
		STATE a streaming
		jetbox_replication_lag_bytes{job="jetbox", instance="a"} 300e6x30
		jetbox_events_published_total{job="jetbox", instance="a"} 0+1000x30
		jetbox_events_duplicate_total{job="jetbox", instance="a"} 0x30
	`, []string{"JetboxLagHigh"}},
	{"slow delivery", `
		up{job="jetbox", instance="a"} 1x30
		STATE a streaming
		jetbox_end_to_end_latency_seconds_bucket{job="jetbox", instance="a", le="1"} 0+90x30
		jetbox_end_to_end_latency_seconds_bucket{job="jetbox", instance="a", le="2.5"} 0+95x30
		jetbox_end_to_end_latency_seconds_bucket{job="jetbox", instance="a", le="5"} 0+100x30
		jetbox_end_to_end_latency_seconds_bucket{job="jetbox", instance="a", le="+Inf"} 0+100x30
	`, []string{"JetboxSlowDelivery"}},
	{"the continuous audit finds rows missing", `
		up{job="jetbox", instance="a"} 1x30
		up{job="jetbox", instance="b"} 1x30
		STATE a streaming
		STATE b standby
		jetbox_audit_missing_rows{job="jetbox", instance="a"} 0x20 3x10
		jetbox_audit_missing_rows{job="jetbox", instance="b"} 0x30
		jetbox_audit_complete_until_timestamp_seconds{job="jetbox", instance="a"} 0+60x20 1200x10
		jetbox_audit_complete_until_timestamp_seconds{job="jetbox", instance="b"} 0x30
	`, []string{"JetboxAuditGap"}},
	{"the continuous audit stopped advancing", `
		up{job="jetbox", instance="a"} 1x30
		up{job="jetbox", instance="b"} 1x30
		STATE a streaming
		STATE b standby
		jetbox_audit_missing_rows{job="jetbox", instance="a"} 0x30
		jetbox_audit_complete_until_timestamp_seconds{job="jetbox", instance="a"} -20000x30
		jetbox_audit_complete_until_timestamp_seconds{job="jetbox", instance="b"} 0x30
	`, []string{"JetboxAuditStalled"}},
	{"a standby holds no persisted copy of the slot", `
		up{job="jetbox", instance="a"} 1x30
		up{job="jetbox", instance="b"} 1x30
		STATE a streaming
		STATE b standby
		jetbox_failover_slot_ready{job="jetbox", instance="a", standby="pg-1:5432"} 1x30
		jetbox_failover_slot_ready{job="jetbox", instance="a", standby="pg-2:5432"} 0x30
	`, []string{"JetboxFailoverSlotNotReady"}},
	{"publishing waits for a standby of --wait-for-standby-slots", `
		up{job="jetbox", instance="a"} 1x30
		STATE a streaming
		jetbox_standby_slot_waiting{job="jetbox", instance="a"} 0x20 1x10
		jetbox_standby_slot_unguarded{job="jetbox", instance="a"} 0x30
	`, []string{"JetboxStandbySlotWaiting"}},
	{"publishing without waiting for a standby", `
		up{job="jetbox", instance="a"} 1x30
		STATE a streaming
		jetbox_standby_slot_waiting{job="jetbox", instance="a"} 0x30
		jetbox_standby_slot_unguarded{job="jetbox", instance="a"} 0x29 1
	`, []string{"JetboxStandbySlotUnguarded"}},
	{"an automatic repair (--on-lost-slot=repair)", `
		up{job="jetbox", instance="a"} 1x30
		STATE a streaming
		jetbox_repairs_total{job="jetbox", instance="a", cause="promotion"} 0x20 1x10
		jetbox_repairs_total{job="jetbox", instance="a", cause="invalidated"} 0x30
	`, []string{"JetboxAutomaticRepair"}},
	{"flapping NATS connection", `
		up{job="jetbox", instance="a"} 1x30
		STATE a streaming
		jetbox_reconnects_total{job="jetbox", instance="a", side="nats"} 0+1x30
		jetbox_reconnects_total{job="jetbox", instance="a", side="postgres"} 0x30
	`, []string{"JetboxReconnecting"}},
}

// mergeRuleFiles is every rule file of deploy/prometheus as one, a group
// per file.
func mergeRuleFiles(t *testing.T) []byte {
	var groups []map[string]any
	for _, rf := range ruleFiles {
		b, err := os.ReadFile(filepath.Join(repoRoot, "deploy/prometheus", rf.file))
		must(t, err)
		var f struct {
			Groups []map[string]any `yaml:"groups"`
		}
		must(t, yaml.Unmarshal(b, &f))
		for _, g := range f.Groups {
			g["name"] = rf.file + ": " + g["name"].(string)
			groups = append(groups, g)
		}
	}
	out, err := yaml.Marshal(map[string]any{"groups": groups})
	must(t, err)
	return out
}

// TestAlertRulesFire evaluates the rule files of deploy/prometheus with
// Prometheus' own engine over the histories above: an alert fires at the
// end when its expression holds at every evaluation (each minute) over its
// `for`. Each scenario fires exactly the alerts it names, so every alert both
// fires when it should and stays quiet in a healthy deployment.
func TestAlertRulesFire(t *testing.T) {
	rgs := parseRules(t, "deploy/prometheus", mergeRuleFiles(t), withExporterSeries(exportedSeries(t)))
	engine := promql.NewEngine(promql.EngineOpts{MaxSamples: 1e6, Timeout: time.Minute, LookbackDelta: 5 * time.Minute,
		Parser: parser.NewParser(parser.Options{})})
	t.Cleanup(func() { engine.Close() })
	end := time.Unix(0, 0).Add(30 * time.Minute)
	fired := map[string]bool{}
	for _, sc := range alertScenarios {
		t.Run(sc.name, func(t *testing.T) {
			st := loadSeries(t, sc.series)
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
						fired[g.Name+": "+r.Alert] = true
					}
				}
			}
			want := slices.Clone(sc.firing)
			slices.Sort(want)
			slices.Sort(got)
			if !slices.Equal(got, want) {
				t.Errorf("firing %v, want %v", got, want)
			}
		})
	}
	for _, g := range rgs.Groups {
		for _, r := range g.Rules {
			if r.Alert != "" && !fired[g.Name+": "+r.Alert] {
				t.Errorf("no scenario makes %s (%s) fire", r.Alert, g.Name)
			}
		}
	}
}

// loadSeries reads series in the notation of Prometheus' rule tests
// (`name{labels} 0+5x30`: one sample a minute from time 0) into an in-memory
// store for the PromQL engine.
func loadSeries(t *testing.T, text string) storage.Queryable {
	t.Helper()
	p := parser.NewParser(parser.Options{})
	var lines []string
	for _, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if f := strings.Fields(line); len(f) == 3 && f[0] == "STATE" {
			for _, st := range allStatesForTest {
				v := "0x30"
				if st == f[2] {
					v = "1x30"
				}
				lines = append(lines, fmt.Sprintf("jetbox_state{job=\"jetbox\", instance=%q, state=%q} %s", f[1], st, v))
			}
		} else if line != "" {
			lines = append(lines, line)
		}
	}
	var all []storage.Series
	for _, line := range lines {
		lbls, vals, err := p.ParseSeriesDesc(line)
		if err != nil {
			t.Fatalf("series %q: %v", line, err)
		}
		var samples []chunks.Sample
		for i, v := range vals {
			if !v.Omitted {
				samples = append(samples, floatSample{t: int64(i) * time.Minute.Milliseconds(), f: v.Value})
			}
		}
		all = append(all, storage.NewListSeries(lbls, samples))
	}
	return queryableOf(all)
}

// queryableOf serves series to the PromQL engine.
func queryableOf(all []storage.Series) storage.Queryable {
	return &storage.MockQueryable{MockQuerier: &storage.MockQuerier{SelectMockFunction: func(_ bool, _ *storage.SelectHints, ms ...*labels.Matcher) storage.SeriesSet {
		var out []storage.Series
		for _, s := range all {
			ok := true
			for _, m := range ms {
				ok = ok && m.Matches(s.Labels().Get(m.Name))
			}
			if ok {
				out = append(out, s)
			}
		}
		slices.SortFunc(out, func(a, b storage.Series) int { return labels.Compare(a.Labels(), b.Labels()) })
		return &seriesList{list: out, i: -1}
	}}}
}

type floatSample struct {
	t int64
	f float64
}

func (s floatSample) T() int64                      { return s.t }
func (s floatSample) ST() int64                     { return 0 }
func (s floatSample) F() float64                    { return s.f }
func (s floatSample) H() *histogram.Histogram       { return nil }
func (s floatSample) FH() *histogram.FloatHistogram { return nil }
func (s floatSample) Type() chunkenc.ValueType      { return chunkenc.ValFloat }
func (s floatSample) Copy() chunks.Sample           { return s }

type seriesList struct {
	list []storage.Series
	i    int
}

func (l *seriesList) Next() bool                        { l.i++; return l.i < len(l.list) }
func (l *seriesList) At() storage.Series                { return l.list[l.i] }
func (l *seriesList) Err() error                        { return nil }
func (l *seriesList) Warnings() annotations.Annotations { return nil }
