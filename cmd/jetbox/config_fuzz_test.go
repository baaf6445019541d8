package main

import (
	"errors"
	"strings"
	"testing"

	"github.com/alecthomas/kong"
	"github.com/jetbox-dev/jetbox/decoder"
)

// FuzzConfig: any command line (one argument per line) either parses into
// a configuration whose values hold their invariants, or fails with errors
// that each name a flag and its fix; never a panic.
func FuzzConfig(f *testing.F) {
	for _, seed := range []string{
		"--postgres-url=postgres://u@127.0.0.1/db",
		"--postgres-url=postgres://u@127.0.0.1/db\n--on-invalid=dead-letter\n--dead-letter-subject=outbox._dlq",
		"--postgres-url=x\n--nats-url=http://x\n--table=a.b.c\n--slot=Bad\n--max-in-flight=0",
		"--postgres-url=postgres://u@h/db\n--delivery=exactly-once\n--order-guard=false",
		"--postgres-url=postgres://u@h/db\n--subject-prefix=a.*\n--max-in-flight-bytes=1GiB\n--publish-timeout=91s",
		"--postgres-url=postgres://u@h/db\n--nats-url=embedded\n--nats-listen=nope",
		"--postgres-url=postgres://u@h/db\n--on-invalid=dead-letter\n--dead-letter-subject=outbox.order",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, lines string) {
		var c cli
		parser, err := kong.New(&c, kong.Exit(func(int) {}), kong.Writers(discard{}, discard{}), kong.Vars(flagVars))
		if err != nil {
			t.Fatal(err)
		}
		args := append([]string{"run"}, strings.Split(lines, "\n")...)
		if _, err := parser.Parse(args); err != nil {
			return
		}
		cfg, err := c.Run.Config()
		if err != nil {
			var joined interface{ Unwrap() []error }
			if !errors.As(err, &joined) {
				t.Fatalf("not a list of problems: %v", err)
			}
			for _, e := range joined.Unwrap() {
				var ce *ConfigError
				if !errors.As(e, &ce) || ce.Flag == "" || ce.Fix == "" {
					t.Fatalf("problem without flag or fix: %v", e)
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
		if s.ExactlyOnce && !s.OrderGuard {
			t.Fatal("exactly-once accepted without the order guard")
		}
	})
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }
