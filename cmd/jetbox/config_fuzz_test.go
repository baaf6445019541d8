package main

import (
	"errors"
	"regexp"
	"strings"
	"testing"

	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/sink"
)

// FuzzConfig: any command line (one argument per line; a line
// JETBOX_NAME=value sets that variable instead) either parses into a
// configuration whose values hold their invariants, or fails with exit 2 and
// errors that each name a flag and its fix, every one of them printed; never
// a panic. One execution is pure: the parser is built once per process
// (kong resets every value on each Parse) and nothing dials anything.
func FuzzConfig(f *testing.F) {
	for _, seed := range []string{
		"--postgres-url=postgres://u@127.0.0.1/db",
		"--postgres-url=postgres://u@127.0.0.1/db\n--on-invalid=dead-letter\n--dead-letter-subject=outbox._dlq",
		"--postgres-url=x\n--nats-url=http://x\n--table=a.b.c\n--slot=Bad\n--max-in-flight=0",
		"--postgres-url=postgres://u@h/db\n--delivery=exactly-once\n--order-guard=false",
		"--postgres-url=postgres://u@h/db\n--subject-prefix=a.*\n--max-in-flight-bytes=1GiB\n--publish-timeout=91s",
		"--postgres-url=postgres://u@h/db\n--nats-url=embedded\n--nats-listen=nope",
		"--postgres-url=postgres://u@h/db\n--on-invalid=dead-letter\n--dead-letter-subject=outbox.order",
		"JETBOX_POSTGRES_URL=postgres://u@h/db\nJETBOX_DELIVERY=exactly-once\n--atomic-transactions=true",
		"JETBOX_MONITOR_INTERVAL=1ms\nJETBOX_ON_INVALID=dead-letter\n--dead-letter-subject=x",
		"--postgres-url=postgres://u@h/db\n--nats-context=nosuch\n--nats-token=x",
		"--postgres-url=postgres://u@h/db\n--source=table,messages\n--subject-template={prefix}.{aggregate_type}.{partition}.{event_type}\n--partitions=4",
		"--postgres-url=postgres://u@h/db\n--source=messages,messages\n--message-prefix=jetbox-heartbeat\n--subject-template={aggregate_type}\n--partitions=x",
		"JETBOX_POSTGRES_URL=postgres://u@h/db\nJETBOX_SOURCE=messages\nJETBOX_PARTITIONS=3",
		"--postgres-url=postgres://u@h/db\n--publish-timeout=soon\n--max-in-flight=many\n--max-retained-wal=lots\nJETBOX_STREAM_MAX_BYTES=1",
		"--postgres-url=postgres://u@h/db\n--max-in-flight\n512\n--stream-replicas=auto\n--stream-max-msgs=-1\n--accept-lost-rows",
		"--help",
	} {
		f.Add(seed)
	}
	var c cli
	exitCode := -1
	var stderr strings.Builder
	parser, err := newParser(&c, discard{}, &stderr, &exitCode)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, lines string) {
		args := []string{"run"}
		for _, line := range strings.Split(lines, "\n") {
			if name, value, ok := strings.Cut(line, "="); ok && envVar.MatchString(name) && !strings.ContainsRune(value, 0) {
				t.Setenv(name, value)
				continue
			}
			args = append(args, line)
		}
		stderr.Reset()
		kctx, code := parseCommand(parser, &exitCode, args, &stderr)
		if kctx == nil {
			if code != exitConfig && code != exitOK { // exitOK: --help
				t.Fatalf("parse ended with exit %d", code)
			}
			return
		}
		cfg, code := runConfig(&c.Run, &stderr)
		if code != exitOK {
			if code != exitConfig {
				t.Fatalf("invalid configuration ends with exit %d, want %d", code, exitConfig)
			}
			_, err := c.Run.Config()
			var joined interface{ Unwrap() []error }
			if !errors.As(err, &joined) {
				t.Fatalf("not a list of problems: %v", err)
			}
			printed := plainLog(stderr.String())
			for _, e := range joined.Unwrap() {
				var ce *ConfigError
				if !errors.As(e, &ce) || ce.Flag == "" || ce.Hint == "" {
					t.Fatalf("problem without flag or fix: %v", e)
				}
				if !strings.Contains(printed, e.Error()) {
					t.Fatalf("problem not printed: %v\n%s", e, printed)
				}
			}
			return
		}
		r, s := cfg.Replication, cfg.Sink
		if r.MaxInFlight < 1 || s.MaxPending != r.MaxInFlight || decoder.ValidPrefix(s.SubjectPrefix) != nil || r.StatusInterval <= 0 {
			t.Fatalf("accepted an invalid configuration: %+v", cfg)
		}
		if dl := r.Decoder.DeadLetterSubject; dl != s.DeadLetterSubject || (dl != "" && decoder.ValidPrefix(dl) != nil) {
			t.Fatalf("dead-letter subject %q / %q", dl, s.DeadLetterSubject)
		}
		if tpl := r.Decoder.Subjects; tpl != nil && !sink.Captures([]string{s.SubjectPrefix + ".>"}, s.SubjectFilter) {
			t.Fatalf("template %s produces subjects outside %s.>", tpl, s.SubjectPrefix)
		}
		if r.Decoder.MessagePrefix == decoder.HeartbeatPrefix || (r.Decoder.MessagePrefix == "" && r.Decoder.Table == "") {
			t.Fatalf("source: table %q, message prefix %q", r.Decoder.Table, r.Decoder.MessagePrefix)
		}
		if s.Delivery.ExactlyOnce() && !s.Delivery.Guarded() {
			t.Fatal("exactly-once accepted without the order guard")
		}
	})
}

// envVar is a line of a FuzzConfig input that sets a variable.
var envVar = regexp.MustCompile(`^JETBOX_[A-Z0-9_]+$`)

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }
