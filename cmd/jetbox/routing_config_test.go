package main

import (
	"bytes"
	"os"
	"strings"
	"testing"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jetbox-dev/jetbox/decoder"
)

// TestRoutingConfig: --source, --message-prefix, --subject-template and
// --partitions reach the decoder and the sink, and their mistakes are
// reported together with the others, each with its fix.
func TestRoutingConfig(t *testing.T) {
	f := RunFlags{}
	parseDefaults(t, &f)
	f.PostgresURL = "postgres://u@127.0.0.1/db"
	f.Source, f.SubjectTemplate = "table, messages", "{prefix}.{aggregate_type}.p{partition}.{event_type}"
	f.Partitions.set("8")
	cfg, err := f.Config()
	if err != nil {
		t.Fatal(err)
	}
	d := cfg.Replication.Decoder
	if d.Table != "outbox" || d.MessagePrefix != "jetbox" || d.Subjects == nil || d.Subjects.Partitions() != 8 || cfg.Sink.SubjectFilter != "outbox.*.*.*" || cfg.Sink.IndexScheme != "table,messages:jetbox" {
		t.Fatalf("decoder %+v, sink filter %q, index scheme %q", d, cfg.Sink.SubjectFilter, cfg.Sink.IndexScheme)
	}
	f.Source, f.SubjectTemplate = "messages", decoder.DefaultSubjectTemplate
	f.Partitions.set("0")
	if cfg, err = f.Config(); err != nil {
		t.Fatal(err)
	}
	if d := cfg.Replication.Decoder; d.Table != "" || d.MessagePrefix != "jetbox" || d.Subjects != nil || cfg.Sink.SubjectFilter != "outbox.*.*" || cfg.Sink.IndexScheme != "messages:jetbox" {
		t.Fatalf("messages only: %+v, index scheme %q", d, cfg.Sink.IndexScheme)
	}
	f.Source = "table"
	if cfg, _ = f.Config(); cfg.Replication.Decoder.MessagePrefix != "" || cfg.Sink.IndexScheme != "" {
		t.Fatalf("table source streams messages (index scheme %q)", cfg.Sink.IndexScheme)
	}

	var out, errOut bytes.Buffer
	code := realMain([]string{"run", "--postgres-url=postgres://x@127.0.0.1/db", "--source=table,rows", "--message-prefix=jetbox-heartbeat",
		"--subject-template={prefix}.{aggregate_type}.{aggregateid}"}, &out, &errOut)
	for _, want := range []string{`--source (JETBOX_SOURCE) = "table,rows": unknown source "rows"`, "--subject-template (JETBOX_SUBJECT_TEMPLATE)", "unknown placeholder {aggregateid}"} {
		if code != exitConfig || !strings.Contains(plainLog(errOut.String()), want) {
			t.Errorf("exit %d, output lacks %q:\n%s", code, want, plainLog(errOut.String()))
		}
	}
	errOut.Reset()
	code = realMain([]string{"run", "--postgres-url=postgres://x@127.0.0.1/db", "--source=messages", "--message-prefix=jetbox-heartbeat", "--partitions=4"}, &out, &errOut)
	for _, want := range []string{"--message-prefix (JETBOX_MESSAGE_PREFIX)", "heartbeats", "--partitions (JETBOX_PARTITIONS)", "has no {partition} token"} {
		if code != exitConfig || !strings.Contains(plainLog(errOut.String()), want) {
			t.Errorf("exit %d, output lacks %q:\n%s", code, want, plainLog(errOut.String()))
		}
	}
	errOut.Reset()
	code = realMain([]string{"run", "--postgres-url=postgres://x@127.0.0.1/db", "--subject-template={prefix}.{partition}"}, &out, &errOut)
	if code != exitConfig || !strings.Contains(plainLog(errOut.String()), "number of partitions is 0") {
		t.Errorf("{partition} without --partitions: exit %d:\n%s", code, plainLog(errOut.String()))
	}
}

// TestMessagePrefixValidated: --message-prefix goes into the
// Jetbox-Index-Scheme header of every message, so a prefix that cannot be
// a header value (CR/LF, "Nats-", a space at an end) is refused, reported
// with the other problems, each with its fix.
func TestMessagePrefixValidated(t *testing.T) {
	for _, p := range []string{"a\r\nNats-Msg-Id: x", "acme\n", "Nats-x", "x-Nats-y", " jetbox", "jetbox\t", strings.Repeat("p", decoder.MaxMessagePrefix+1)} {
		var out, errOut bytes.Buffer
		code := realMain([]string{"run", "--postgres-url=postgres://x@127.0.0.1/db", "--source=messages", "--message-prefix=" + p, "--max-in-flight=0"}, &out, &errOut)
		for _, want := range []string{"--message-prefix (JETBOX_MESSAGE_PREFIX)", "fix: use the prefix your producers pass", "--max-in-flight (JETBOX_MAX_IN_FLIGHT)"} {
			if code != exitConfig || !strings.Contains(plainLog(errOut.String()), want) {
				t.Errorf("prefix %q: exit %d, output lacks %q:\n%s", p, code, want, plainLog(errOut.String()))
			}
		}
	}
	if decoder.ValidMessagePrefix("\xff") == nil {
		t.Error("invalid UTF-8 accepted")
	}
	f := RunFlags{}
	parseDefaults(t, &f)
	f.PostgresURL, f.Source = "postgres://u@127.0.0.1/db", "messages"
	for _, p := range []string{"jetbox", "acme.outbox:v2", "événements", "nats-lower"} {
		f.MessagePrefix = p
		if cfg, err := f.Config(); err != nil || cfg.Sink.IndexScheme != "messages:"+p {
			t.Errorf("prefix %q: %v", p, err)
		}
	}
}

// parseDefaults fills f with the flags' defaults, as kong would, with no
// JETBOX_* variable of the environment in the way.
func parseDefaults(t *testing.T, f *RunFlags) {
	t.Helper()
	for _, kv := range os.Environ() {
		if name, _, _ := strings.Cut(kv, "="); strings.HasPrefix(name, "JETBOX_") {
			t.Setenv(name, "")
			os.Unsetenv(name)
		}
	}
	var c cli
	exitCode := -1
	var stderr strings.Builder
	parser, err := newParser(&c, discard{}, &stderr, &exitCode)
	if err != nil {
		t.Fatal(err)
	}
	if kctx, code := parseCommand(parser, &exitCode, []string{"run"}, &stderr); kctx == nil {
		t.Fatalf("parse: exit %d %s", code, stderr.String())
	}
	*f = c.Run
}

// TestTemplateAndPartitionProblemsTogether: a bad --partitions does not hide
// the template's own problem, and a template's syntax error is never blamed
// on --partitions (found by a review).
func TestTemplateAndPartitionProblemsTogether(t *testing.T) {
	for _, c := range []struct {
		args []string
		want []string
		not  string
	}{
		{[]string{"--partitions=x", "--subject-template={prefix}..{event_type}"},
			[]string{"--partitions (JETBOX_PARTITIONS)", "--subject-template (JETBOX_SUBJECT_TEMPLATE)"}, ""},
		{[]string{"--partitions=4", "--subject-template={prefix}.{aggregate_type}..{event_type}"},
			[]string{"--subject-template (JETBOX_SUBJECT_TEMPLATE)"}, "--partitions (JETBOX_PARTITIONS)"},
	} {
		var out, errOut bytes.Buffer
		code := realMain(append([]string{"run", "--postgres-url=postgres://x@127.0.0.1/db"}, c.args...), &out, &errOut)
		for _, want := range c.want {
			if code != exitConfig || !strings.Contains(plainLog(errOut.String()), want) {
				t.Errorf("%v: exit %d, output lacks %q:\n%s", c.args, code, want, plainLog(errOut.String()))
			}
		}
		if c.not != "" && strings.Contains(plainLog(errOut.String()), c.not) {
			t.Errorf("%v: blames %s:\n%s", c.args, c.not, plainLog(errOut.String()))
		}
	}
}

// TestDeadLetterHintNamesSubject: the way past an invalid row that an exit
// or a repair prints names the configured --dead-letter-subject, not
// <prefix>._dlq; without dead-lettering, the subject it would use.
func TestDeadLetterHintNamesSubject(t *testing.T) {
	f := RunFlags{}
	parseDefaults(t, &f)
	f.PostgresURL, f.OnInvalid, f.DeadLetterSubj = "postgres://u@127.0.0.1/db", "dead-letter", "events.dlq"
	cfg, err := f.Config()
	if err != nil {
		t.Fatal(err)
	}
	got := deadLetterNext(cfg, format.ReasonTooLarge, "restart")
	if !strings.Contains(got, "events.dlq.too-large") || strings.Contains(got, "._dlq") || strings.Contains(got, "restart with --on-invalid") {
		t.Errorf("with --dead-letter-subject: %q", got)
	}
	f.OnInvalid, f.DeadLetterSubj = "stop", ""
	if cfg, err = f.Config(); err != nil {
		t.Fatal(err)
	}
	if got := deadLetterNext(cfg, format.ReasonBadSubject, "restart"); !strings.Contains(got, "restart with --on-invalid=dead-letter to publish it to outbox._dlq.bad-subject") {
		t.Errorf("stop: %q", got)
	}
}
