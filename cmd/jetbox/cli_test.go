package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// TestBareBooleanFlags: the boolean flags may be written bare, as the
// README does (--atomic-transactions), or with a value; a bad value is
// still reported with the other configuration problems.
func TestBareBooleanFlags(t *testing.T) {
	var out, errOut bytes.Buffer
	// Bare: true, so atomic mode's rule (exactly-once) applies and is reported.
	code := realMain([]string{"run", "--postgres-url=postgres://x@127.0.0.1/db", "--delivery=dedup", "--atomic-transactions"}, &out, &errOut)
	if code != exitConfig || !strings.Contains(plainLog(errOut.String()), `--atomic-transactions (JETBOX_ATOMIC_TRANSACTIONS) = "true": needs --delivery=exactly-once`) {
		t.Fatalf("bare --atomic-transactions: exit %d, stderr %s", code, plainLog(errOut.String()))
	}
	errOut.Reset()
	code = realMain([]string{"run", "--postgres-url=postgres://x@127.0.0.1/db", "--order-guard=maybe", "--accept-lost-rows=perhaps", "--slot=Bad-Slot"}, &out, &errOut)
	for _, want := range []string{`--order-guard (JETBOX_ORDER_GUARD) = "maybe": not a boolean`, `--accept-lost-rows (JETBOX_ACCEPT_LOST_ROWS) = "perhaps": not a boolean`, "--slot"} {
		if code != exitConfig || !strings.Contains(plainLog(errOut.String()), want) {
			t.Fatalf("exit %d, stderr lacks %q:\n%s", code, want, plainLog(errOut.String()))
		}
	}
	t.Setenv("JETBOX_ATOMIC_TRANSACTIONS", "nope")
	errOut.Reset()
	if code := realMain([]string{"run", "--postgres-url=postgres://x@127.0.0.1/db"}, &out, &errOut); code != exitConfig ||
		!strings.Contains(plainLog(errOut.String()), `= "nope": not a boolean`) {
		t.Fatalf("JETBOX_ATOMIC_TRANSACTIONS=nope: exit %d, stderr %s", code, plainLog(errOut.String()))
	}
}

// TestVersionFlag: jetbox --version and jetbox version print the same line.
func TestVersionFlag(t *testing.T) {
	var flag, cmd, errOut bytes.Buffer
	if code := realMain([]string{"--version"}, &flag, &errOut); code != exitOK || !strings.HasPrefix(flag.String(), "jetbox ") {
		t.Fatalf("--version: exit %d, stdout %q, stderr %q", code, flag.String(), plainLog(errOut.String()))
	}
	if code := realMain([]string{"version"}, &cmd, &errOut); code != exitOK || cmd.String() != flag.String() {
		t.Fatalf("version: exit %d, %q; --version printed %q", code, cmd.String(), flag.String())
	}
	if !strings.Contains(flag.String(), "(commit ") || strings.Contains(flag.String(), "commit none") {
		t.Fatalf("version line %q: want a commit from the link flags or the build info, else unknown", flag.String())
	}
}

// TestLogLineTimeAndDurations: JSON log lines carry their time to the
// nanosecond (RFC 3339, UTC) and durations as durations ("1.5s").
func TestLogLineTimeAndDurations(t *testing.T) {
	var buf bytes.Buffer
	log := newLogger(Config{LogLevel: zerolog.InfoLevel}, &buf)
	log.Info().Stringer("backoff", 1500*time.Millisecond).Msg("x")
	var line map[string]any
	if err := json.Unmarshal(buf.Bytes(), &line); err != nil {
		t.Fatalf("%v: %s", err, buf.String())
	}
	ts, _ := line["time"].(string)
	parsed, err := time.Parse(time.RFC3339Nano, ts)
	if err != nil || !strings.Contains(ts, ".") || !strings.HasSuffix(ts, "Z") || time.Since(parsed) > time.Minute {
		t.Fatalf("time %q (%v): want RFC 3339 in UTC with sub-seconds", ts, err)
	}
	if line["backoff"] != "1.5s" {
		t.Fatalf("backoff %v, want 1.5s", line["backoff"])
	}
}

// TestRunHelp: jetbox run --help groups the flags, shows typed placeholders
// with their defaults (not --partitions="0"), and names the OTEL_*
// variables that configure tracing.
func TestRunHelp(t *testing.T) {
	var out, errOut bytes.Buffer
	if code := realMain([]string{"run", "--help"}, &out, &errOut); code != exitOK {
		t.Fatalf("exit %d: %s", code, plainLog(errOut.String()))
	}
	help := out.String()
	for _, want := range []string{"Postgres and the outbox", "NATS", "Stream and subjects", "Delivery and recovery", "Timing and limits",
		"Operations (HTTP, logs)", "Outbox columns", "--partitions=N", "(default: 0)", "--status-interval=DURATION", "OTEL_PROPAGATORS",
		"OTEL_EXPORTER_OTLP_ENDPOINT", "--atomic-transactions "} {
		if !strings.Contains(help, want) {
			t.Errorf("run --help lacks %q", want)
		}
	}
	if strings.Contains(help, `--partitions="0"`) {
		t.Error(`run --help shows --partitions="0"`)
	}
}

// plainLog returns jetbox's output with each JSON log line replaced by its
// message, the way printProblems lists a problem, for tests that look for a
// problem's text whatever the log format.
func plainLog(s string) string {
	lines := strings.Split(s, "\n")
	for i, l := range lines {
		var m struct {
			Message string `json:"message"`
		}
		if strings.HasPrefix(l, "{") && json.Unmarshal([]byte(l), &m) == nil && m.Message != "" {
			lines[i] = "  - " + m.Message
		}
	}
	return strings.Join(lines, "\n")
}

// TestConfigProblemsInLogFormat: jetbox run reports its configuration
// problems in the log format asked for: JSON log lines by default (one per
// problem, then a summary), text with --log-format=console or when the log
// format is itself a problem.
func TestConfigProblemsInLogFormat(t *testing.T) {
	bad := []string{"run", "--postgres-url=postgres://x@127.0.0.1/db", "--status-interval=forever", "--partitions=x"}
	var out, errOut bytes.Buffer
	if code := realMain(bad, &out, &errOut); code != exitConfig {
		t.Fatalf("exit %d, want %d", code, exitConfig)
	}
	lines := strings.Split(strings.TrimSpace(errOut.String()), "\n")
	if len(lines) != 3 {
		t.Fatalf("%d lines, want 2 problems and a summary:\n%s", len(lines), errOut.String())
	}
	for i, l := range lines {
		var m struct {
			Level, Kind, Message, Time string
			Problem, Of, Problems      int
		}
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("line %d is not JSON: %v\n%s", i+1, err, l)
		}
		if m.Level != "error" || m.Kind != "configuration" || m.Message == "" || m.Time == "" {
			t.Errorf("line %d: %+v", i+1, m)
		}
		if i < 2 && (m.Problem != i+1 || m.Of != 2) || i == 2 && m.Problems != 2 {
			t.Errorf("line %d numbers: %+v", i+1, m)
		}
	}
	for _, format := range []string{"console", "xml"} {
		errOut.Reset()
		realMain(append(bad, "--log-format="+format), &out, &errOut)
		if !strings.HasPrefix(errOut.String(), "jetbox: ") || strings.Contains(errOut.String(), "\n{") {
			t.Errorf("--log-format=%s: want text:\n%s", format, errOut.String())
		}
	}
}
