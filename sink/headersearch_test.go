package sink_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/testenv"
	"github.com/nats-io/nats.go/jetstream"
)

// rawPublisher speaks the NATS client protocol over a plain TCP connection,
// so a test controls the header block byte for byte (nats.go writes a
// message's headers in map order).
type rawPublisher struct {
	t    *testing.T
	conn net.Conn
	r    *bufio.Reader
	n    int
}

func dialRaw(t *testing.T, natsURL string) *rawPublisher {
	t.Helper()
	u, err := url.Parse(natsURL)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := net.DialTimeout("tcp", u.Host, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	p := &rawPublisher{t: t, conn: conn, r: bufio.NewReader(conn)}
	if line := p.line(); !strings.HasPrefix(line, "INFO ") {
		t.Fatalf("server said %q, want INFO", line)
	}
	p.send("CONNECT {\"verbose\":false,\"headers\":true,\"no_responders\":true}\r\nSUB _jetbox_ack 1\r\n")
	return p
}

func (p *rawPublisher) send(s string) {
	p.t.Helper()
	_ = p.conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
	if _, err := p.conn.Write([]byte(s)); err != nil {
		p.t.Fatal(err)
	}
}

func (p *rawPublisher) line() string {
	p.t.Helper()
	_ = p.conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	l, err := p.r.ReadString('\n')
	if err != nil {
		p.t.Fatalf("read from nats: %v", err)
	}
	return strings.TrimRight(l, "\r\n")
}

// publish sends one message whose header block holds lines in this order
// and returns JetStream's answer: the sequence stored, or that it was a
// duplicate, or the error.
func (p *rawPublisher) publish(subject string, lines ...string) (seq uint64, duplicate bool, errText string) {
	p.t.Helper()
	hdr := "NATS/1.0\r\n" + strings.Join(lines, "\r\n") + "\r\n\r\n"
	body := fmt.Sprintf(`{"n":%d}`, p.n)
	p.n++
	p.send(fmt.Sprintf("HPUB %s _jetbox_ack %d %d\r\n%s%s\r\n", subject, len(hdr), len(hdr)+len(body), hdr, body))
	for {
		l := p.line()
		switch {
		case l == "PING":
			p.send("PONG\r\n")
		case strings.HasPrefix(l, "-ERR"):
			p.t.Fatalf("nats: %s", l)
		case strings.HasPrefix(l, "MSG ") || strings.HasPrefix(l, "HMSG "):
			f := strings.Fields(l)
			var size, hsize int
			fmt.Sscan(f[len(f)-1], &size)
			if f[0] == "HMSG" {
				fmt.Sscan(f[len(f)-2], &hsize)
			}
			buf := make([]byte, size+2)
			if _, err := io.ReadFull(p.r, buf); err != nil {
				p.t.Fatal(err)
			}
			var ack struct {
				Seq       uint64 `json:"seq"`
				Duplicate bool   `json:"duplicate"`
				Error     *struct {
					Description string `json:"description"`
				} `json:"error"`
			}
			if err := json.Unmarshal(buf[hsize:size], &ack); err != nil {
				p.t.Fatalf("ack %q: %v", buf, err)
			}
			if ack.Error != nil {
				return 0, false, ack.Error.Description
			}
			return ack.Seq, ack.Duplicate, ""
		}
	}
}

// TestServerHeaderSearch shows what a NATS server's header lookup can be
// fooled by: nats-server before 2.11 finds Nats-Msg-Id and the
// Nats-Expected-* headers with a case-sensitive text search over the whole
// header block and ignores them when the first match is not a header name.
// So a header name (X-Nats-Msg-Id) or a value (an id holding
// Nats-Expected-Last-Sequence) placed before the real header turns dedup or
// the order guard off. Other spellings of the text (lower case) do not.
// The decoder refuses rows that could do this (bad-headers, bad-id,
// bad-aggregate-id); the CI matrix runs this against 2.10.
func TestServerHeaderSearch(t *testing.T) {
	n := testenv.StartNATS(t)
	nc, js := n.Connect(t)
	var major, minor int
	if _, err := fmt.Sscanf(nc.ConnectedServerVersion(), "%d.%d", &major, &minor); err != nil {
		t.Fatalf("server version %q: %v", nc.ConnectedServerVersion(), err)
	}
	old := major < 2 || (major == 2 && minor < 11)
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "T", Subjects: []string{"t.>"}}); err != nil {
		t.Fatal(err)
	}
	p := dialRaw(t, n.URL)
	var last uint64
	pub := func(lines ...string) (stored bool, dup bool, errText string) {
		seq, dup, errText := p.publish("t.x", lines...)
		if seq > last && !dup {
			last = seq
			return true, false, errText
		}
		return false, dup, errText
	}
	dedupHidden := func(decoy string) bool {
		t.Helper()
		id := fmt.Sprintf("m-%d", p.n)
		lines := []string{"Nats-Msg-Id: " + id}
		if decoy != "" {
			lines = append([]string{decoy}, lines...)
		}
		if stored, _, e := pub(lines...); !stored {
			t.Fatalf("first publish of %s not stored: %s", id, e)
		}
		stored, _, _ := pub(lines...)
		return stored
	}
	guardHidden := func(decoy string) bool {
		t.Helper()
		lines := []string{"Nats-Expected-Last-Sequence: 999999"}
		if decoy != "" {
			lines = append([]string{decoy}, lines...)
		}
		stored, _, _ := pub(lines...)
		return stored
	}
	cases := []struct {
		name   string
		hidden func() bool
		fools  bool // on servers before 2.11
	}{
		{"no decoy: dedup", func() bool { return dedupHidden("") }, false},
		{"no decoy: guard", func() bool { return guardHidden("") }, false},
		{"header name X-Nats-Msg-Id", func() bool { return dedupHidden("X-Nats-Msg-Id: x") }, true},
		{"header name x-nats-msg-id", func() bool { return dedupHidden("x-nats-msg-id: x") }, false},
		{"header name X-NATS-MSG-ID", func() bool { return dedupHidden("X-NATS-MSG-ID: x") }, false},
		{"header name X-Nats-Expected-Last-Sequence", func() bool { return guardHidden("X-Nats-Expected-Last-Sequence: 1") }, true},
		{"header name x-nats-expected-last-sequence", func() bool { return guardHidden("x-nats-expected-last-sequence: 1") }, false},
		{"value holding Nats-Msg-Id", func() bool { return dedupHidden("Jetbox-Aggregate-Id: Nats-Msg-Id") }, true},
		{"id holding Nats-Expected-Last-Sequence", func() bool { return guardHidden("Nats-Msg-Id: a-Nats-Expected-Last-Sequence") }, true},
		{"id holding nats-expected-last-sequence", func() bool { return guardHidden("Nats-Msg-Id: a-nats-expected-last-sequence") }, false},
	}
	t.Logf("nats-server %s", nc.ConnectedServerVersion())
	for _, c := range cases {
		want := c.fools && old
		if got := c.hidden(); got != want {
			t.Errorf("%s on nats-server %s: header hidden = %v, want %v", c.name, nc.ConnectedServerVersion(), got, want)
		}
	}
}
