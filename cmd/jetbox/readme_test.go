package main

import (
	"os"
	"reflect"
	"strings"
	"testing"
)

// TestREADMEConfigTable keeps the configuration table in docs/configuration.md
// complete (every flag of `jetbox run` has a row with its env variable and
// default) and the README's outbox DDL equal to the one the tests use.
func TestREADMEConfigTable(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), outboxDDL) {
		t.Error("the README's outbox DDL differs from the one the demo and the tests use")
	}
	conf, err := os.ReadFile("../../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(conf)
	rt := reflect.TypeOf(RunFlags{})
	for i := 0; i < rt.NumField(); i++ {
		f := rt.Field(i)
		name, env, def := f.Tag.Get("name"), f.Tag.Get("env"), os.Expand(f.Tag.Get("default"), func(v string) string { return flagVars[v] })
		if env != envName(name) {
			t.Errorf("flag --%s has env %s, want %s", name, env, envName(name))
		}
		row := "| `" + env + "` | `--" + name + "` | "
		idx := strings.Index(doc, row)
		if idx < 0 {
			t.Errorf("docs/configuration.md lacks a configuration row starting %q", row)
			continue
		}
		rest := doc[idx+len(row):]
		cell := strings.TrimSpace(rest[:strings.Index(rest, "|")])
		if def != "" && cell != "`"+def+"`" {
			t.Errorf("docs/configuration.md default for --%s is %s, code says %q", name, cell, def)
		}
	}
}

// TestRoutingDocFunction keeps docs/routing.md's jetbox_emit equal to the
// one the demo and the tests use.
func TestRoutingDocFunction(t *testing.T) {
	doc, err := os.ReadFile("../../docs/routing.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(doc), emitFunctionDDL) {
		t.Error("docs/routing.md's jetbox_emit differs from the one the demo and the tests use")
	}
}
