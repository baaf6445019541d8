package main

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/jetbox-dev/jetbox/internal/natsembed"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
)

// TestDeleteStreamWaitsForFiles: deleteStream returns once the server has
// removed the stream's files, not when it answered (it removes them in the
// background), and it finds them where the server keeps them.
func TestDeleteStreamWaitsForFiles(t *testing.T) {
	store := t.TempDir()
	js := startJetStream(t, store)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "GONE", Subjects: []string{"gone"}, Storage: jetstream.FileStorage}); err != nil {
		t.Fatal(err)
	}
	payload := make([]byte, 1024)
	for i := 0; i < 2000; i++ {
		if _, err := js.PublishAsync("gone", payload); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-ctx.Done():
		t.Fatal("publish timeout")
	}
	dir := filepath.Join(store, "jetstream", "$G", "streams", "GONE")
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("the stream's files are not where deleteStream looks: %v", err)
	}
	s := &servers{natsStore: store, js: js, log: zerolog.Nop()}
	if err := s.deleteStream(ctx, "GONE"); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{dir, filepath.Join(filepath.Dir(dir), ".GONE")} {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Fatalf("%s still there after deleteStream (%v)", d, err)
		}
	}
}

// startJetStream starts an in-process nats-server with its file store in
// store, stopped when the test ends, and connects to it.
func startJetStream(t *testing.T, store string) jetstream.JetStream {
	t.Helper()
	srv, err := natsembed.Start(natsembed.Options{StoreDir: store})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { natsembed.Stop(srv) })
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}
