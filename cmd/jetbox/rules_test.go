package main

import (
	"bytes"
	"errors"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

var updateAlerts = flag.Bool("update-alerts", false, "rewrite deploy/prometheus/*.yaml from the chart's rules (templates/_alerts.tpl)")

// jetboxRules are the rules on jetbox's own series, in the chart's order;
// databaseRules those on the database exporters' series.
var (
	jetboxRules = []string{"JetboxDown", "JetboxAllDown", "JetboxNotStreaming", "JetboxStandbyWithoutActive", "JetboxStalled",
		"JetboxNoRecentAck", "JetboxLagHigh", "JetboxRetainedWAL", "JetboxInvalidRows", "JetboxPublishFailing", "JetboxSlowDelivery", "JetboxReconnecting",
		"JetboxAuditGap", "JetboxAuditStalled", "JetboxFailoverSlotNotReady", "JetboxStandbySlotWaiting", "JetboxStandbySlotUnguarded", "JetboxAutomaticRepair"}
	databaseRules = []string{"JetboxSlotRetainedWAL", "JetboxSlotInactive"}
)

const runbookURL = "https://github.com/jetbox-dev/jetbox/blob/main/docs/operations.md"

// dbOnly are the values rendering only the database rules of source.
func dbOnly(source string) []string {
	set := []string{"prometheusRule.database.source=" + source}
	for _, r := range jetboxRules {
		set = append(set, "prometheusRule.rules."+r+".enabled=false")
	}
	return set
}

// ruleFiles are the plain rule files in deploy/prometheus: the chart's rules
// rendered for job="jetbox" (go test -run TestHelmChart -update-alerts
// rewrites them).
var ruleFiles = []struct {
	file, header string
	set          []string
}{
	{"alerts.yaml", `# Prometheus alerting rules for jetbox (docs/operations.md#alerts), generated from the
# Helm chart's rules (deploy/helm/jetbox/templates/_alerts.tpl) for job="jetbox":
#   go test ./cmd/jetbox -run TestHelmChart -update-alerts
#
#   rule_files: [/etc/prometheus/jetbox-alerts.yaml]      # plain Prometheus (name the scrape job jetbox)
#   helm: prometheusRule.enabled=true                      # Prometheus Operator: the same rules, scoped by
#                                                          # prometheusRule.selector, tunable in values
#
# They group by (namespace, job): every instance of one deployment shares one
# slot, so "is any instance streaming" and "is anything acked" are questions
# about the deployment, not one pod. Each runbook_url is the section of
# docs/operations.md that says what to do. Checked by TestAlertRules,
# TestAlertRulesFire and TestAlertRulesOnScrapedSeries (cmd/jetbox).
`, nil},
	{"database-alerts-cloudnativepg.yaml", `# The slot's retained WAL seen from CloudNativePG's metrics (its default
# monitoring queries: cnpg_pg_replication_slots_*), for when jetbox itself is
# down, which is when the slot retains WAL; slot jetbox. Generated from the
# Helm chart (prometheusRule.database.source=cloudnativepg):
#   go test ./cmd/jetbox -run TestHelmChart -update-alerts
`, dbOnly("cloudnativepg")},
	{"database-alerts-postgres-exporter.yaml", `# The slot's WAL seen from postgres_exporter (pg_replication_slot_*), for
# when jetbox itself is down; slot jetbox. postgres_exporter exports no
# restart_lsn: the rule watches the WAL the slot may still retain before
# max_slot_wal_keep_size invalidates it. Generated from the Helm chart
# (prometheusRule.database.source=postgres_exporter):
#   go test ./cmd/jetbox -run TestHelmChart -update-alerts
`, dbOnly("postgres_exporter")},
}

// renderRules renders the chart's PrometheusRule with set and returns its
// spec, as a rule file.
func renderRules(t *testing.T, helm string, set ...string) (string, error) {
	t.Helper()
	args := []string{"template", "jetbox", chartDir, "--namespace", "apps", "--kube-version", defaultKubeVersion,
		"--show-only", "templates/prometheusrule.yaml", "--set", "prometheusRule.enabled=true", "--set", `prometheusRule.selector=job="jetbox"`}
	for _, s := range set {
		args = append(args, "--set", s)
	}
	cmd := exec.Command(helm, args...)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir())
	if err := cmd.Run(); err != nil {
		return "", errors.New(strings.TrimSpace(stderr.String()))
	}
	_, spec, ok := strings.Cut(out.String(), "\nspec:\n")
	if !ok {
		t.Fatalf("no spec in\n%s", out.String())
	}
	var b strings.Builder
	for _, line := range strings.Split(strings.TrimRight(spec, "\n"), "\n") {
		b.WriteString(strings.TrimPrefix(line, "  ") + "\n")
	}
	return b.String(), nil
}

// checkRuleFiles: deploy/prometheus's rule files are the chart's rules.
func checkRuleFiles(t *testing.T, helm string) {
	for _, rf := range ruleFiles {
		rules, err := renderRules(t, helm, rf.set...)
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(repoRoot, "deploy/prometheus", rf.file)
		want := rf.header + rules
		if *updateAlerts {
			must(t, os.WriteFile(path, []byte(want), 0o644))
			continue
		}
		got, err := os.ReadFile(path)
		must(t, err)
		if string(got) != want {
			t.Errorf("deploy/prometheus/%s is not the chart's rules: go test ./cmd/jetbox -run TestHelmChart -update-alerts", rf.file)
		}
	}
}

// checkRuleValues: each rule is switched off on its own, its threshold and
// for: follow values, and the selector scopes every series a rule selects.
func checkRuleValues(t *testing.T, helm string) {
	alerts := func(rules string) []string {
		return regexp.MustCompile(`(?m)^\s+- alert: (\S+)$`).FindAllString(rules, -1)
	}
	all, err := renderRules(t, helm)
	must(t, err)
	for _, r := range jetboxRules {
		off, err := renderRules(t, helm, "prometheusRule.rules."+r+".enabled=false")
		must(t, err)
		if n, m := len(alerts(all)), len(alerts(off)); m != n-1 || strings.Contains(off, "alert: "+r+"\n") {
			t.Errorf("%s.enabled=false: %d rules of %d, %s still there: %v", r, m, n, r, strings.Contains(off, "alert: "+r+"\n"))
		}
	}
	tuned, err := renderRules(t, helm, "prometheusRule.rules.JetboxLagHigh.lagBytes=1000", "prometheusRule.rules.JetboxLagHigh.for=1h",
		"prometheusRule.rules.JetboxNoRecentAck.seconds=60", "prometheusRule.rules.JetboxInvalidRows.window=1h", "prometheusRule.rules.JetboxDown.severity=critical")
	must(t, err)
	flat := strings.Join(strings.Fields(tuned), " ")
	for _, want := range []string{`(jetbox_replication_lag_bytes{job="jetbox"}) > 1000 for: 1h`, `jetbox_seconds_since_last_ack{job="jetbox"}) > 60`,
		`{action="stop",job="jetbox"}[1h]`, `up{job="jetbox"} == 0 for: 5m labels: severity: critical`} {
		if !strings.Contains(flat, want) {
			t.Errorf("tuned rules lack %q:\n%s", want, tuned)
		}
	}
	scoped, err := renderRules(t, helm, `prometheusRule.selector=namespace="orders"\,job="orders-jetbox"`, "prometheusRule.database.source=cloudnativepg",
		`prometheusRule.database.selector=namespace="db"`, "config.slot=orders")
	must(t, err)
	rgs := parseRules(t, "scoped rules", []byte(scoped), withExporterSeries(exportedSeries(t)))
	for _, g := range rgs.Groups {
		for _, r := range g.Rules {
			e, err := parser.NewParser(parser.Options{}).ParseExpr(r.Expr)
			must(t, err)
			parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
				vs, ok := n.(*parser.VectorSelector)
				if !ok {
					return nil
				}
				want := map[string]string{"namespace": "orders", "job": "orders-jetbox"}
				if slices.Contains(databaseRules, r.Alert) {
					want = map[string]string{"namespace": "db", "slot_name": "orders"}
				}
				for k, v := range want {
					if !slices.ContainsFunc(vs.LabelMatchers, func(m *labels.Matcher) bool { return m.Name == k && m.Type == labels.MatchEqual && m.Value == v }) {
						t.Errorf("%s: %s does not select %s=%q", r.Alert, vs, k, v)
					}
				}
				return nil
			})
		}
	}
	if _, err := renderRules(t, helm, "prometheusRule.database.source=pgwatch"); err == nil || !strings.Contains(err.Error(), "use cloudnativepg or postgres_exporter") {
		t.Errorf("database.source=pgwatch: %v, want a refusal naming the sources", err)
	}
}

// exporterSeries are the series of the database exporters the database
// rules read, with their labels: CloudNativePG's default monitoring queries
// (config/manager/default-monitoring.yaml, pg_replication_slots: slot_name,
// slot_type, database; active, pg_wal_lsn_diff = current LSN - restart_lsn),
// and postgres_exporter's collector/pg_replication_slot.go (slot_name,
// slot_type; safe_wal_size_bytes, slot_is_active).
var exporterSeries = series{
	"cnpg_pg_replication_slots_pg_wal_lsn_diff":    {"slot_name", "slot_type", "database"},
	"cnpg_pg_replication_slots_active":             {"slot_name", "slot_type", "database"},
	"pg_replication_slot_safe_wal_size_bytes":      {"slot_name", "slot_type"},
	"pg_replication_slot_slot_is_active":           {"slot_name", "slot_type"},
	"pg_replication_slot_slot_current_wal_lsn":     {"slot_name", "slot_type"},
	"pg_replication_slot_slot_confirmed_flush_lsn": {"slot_name", "slot_type"},
}

func withExporterSeries(known series) series {
	out := series{}
	for k, v := range known {
		out[k] = v
	}
	for k, v := range exporterSeries {
		out[k] = v
	}
	return out
}

// githubAnchor is the anchor GitHub gives a Markdown heading.
func githubAnchor(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(heading)) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9'):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// checkRunbooks: every rule's runbook_url is a section of docs/operations.md.
func checkRunbooks(t *testing.T, where string, content []byte) {
	ops, err := os.ReadFile(filepath.Join(repoRoot, "docs/operations.md"))
	must(t, err)
	anchors := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^#+ (.+)$`).FindAllStringSubmatch(string(ops), -1) {
		anchors[githubAnchor(m[1])] = true
	}
	rgs := parseRules(t, where, content, withExporterSeries(exportedSeries(t)))
	for _, g := range rgs.Groups {
		for _, r := range g.Rules {
			u := r.Annotations["runbook_url"]
			base, anchor, _ := strings.Cut(u, "#")
			if base != runbookURL || !anchors[anchor] {
				t.Errorf("%s: %s: runbook_url %q is not a section of docs/operations.md", where, r.Alert, u)
			}
		}
	}
}
