package main

import (
	"fmt"
	"io"
	"os"
	"sort"
)

type subcommand struct {
	summary string
	run     func(args []string, stdout, stderr io.Writer) error
}

var subcommands = map[string]subcommand{}

// register adds a subcommand; called from init functions of the files that
// implement them.
func register(name, summary string, run func(args []string, stdout, stderr io.Writer) error) {
	if _, dup := subcommands[name]; dup {
		panic("gonixl-bench: duplicate subcommand " + name)
	}
	subcommands[name] = subcommand{summary: summary, run: run}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: gonixl-bench <subcommand> [flags]")
	names := make([]string, 0, len(subcommands))
	for n := range subcommands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-12s %s\n", n, subcommands[n].summary)
	}
}

func main() {
	if len(os.Args) < 2 || os.Args[1] == "-h" || os.Args[1] == "--help" || os.Args[1] == "help" {
		usage(os.Stdout)
		return
	}
	sc, ok := subcommands[os.Args[1]]
	if !ok {
		fmt.Fprintf(os.Stderr, "gonixl-bench: unknown subcommand %q\n", os.Args[1])
		usage(os.Stderr)
		os.Exit(2)
	}
	if err := sc.run(os.Args[2:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "gonixl-bench "+os.Args[1]+":", err)
		os.Exit(1)
	}
}
