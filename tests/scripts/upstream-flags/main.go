// Prints the flag set of the upstream Harvester cloud provider's command line, as upstream's
// main.go builds it: k8s.io/cloud-provider's NewCloudControllerManagerCommand over
// options.NewCloudControllerManagerOptions (plus the global and logging flags it adds), with
// pflag's WordSepNormalizeFunc. Harvester's own flag set (registerHarvesterFlags in upstream's
// main.go) is not a Go module the proxy serves; those rows are written by hand in the data file.
//
// Output, one flag a line: name<TAB>type<TAB>default<TAB>no-option default (bare form)<TAB>shorthand.
// Then the controller names and aliases upstream's framework knows.
package main

import (
	"fmt"
	"sort"
	"strings"

	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/cloud-provider/app"
	"k8s.io/cloud-provider/names"
	"k8s.io/cloud-provider/options"
	cliflag "k8s.io/component-base/cli/flag"
)

func main() {
	pflag.CommandLine.SetNormalizeFunc(cliflag.WordSepNormalizeFunc)
	o, err := options.NewCloudControllerManagerOptions()
	if err != nil {
		panic(err)
	}
	cmd := app.NewCloudControllerManagerCommand(o, nil, app.DefaultInitFuncConstructors,
		names.CCMControllerAliases(), cliflag.NamedFlagSets{}, wait.NeverStop)
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		fmt.Printf("flag\t%s\t%s\t%s\t%s\t%s\n", f.Name, f.Value.Type(),
			strings.ReplaceAll(f.DefValue, "\t", " "), f.NoOptDefVal, f.Shorthand)
	})
	var ctrls []string
	for name := range app.DefaultInitFuncConstructors {
		ctrls = append(ctrls, name)
	}
	sort.Strings(ctrls)
	for _, c := range ctrls {
		fmt.Printf("controller\t%s\n", c)
	}
	aliases := names.CCMControllerAliases()
	var keys []string
	for k := range aliases {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Printf("alias\t%s\t%s\n", k, aliases[k])
	}
	for _, c := range app.ControllersDisabledByDefault.UnsortedList() {
		fmt.Printf("disabled-by-default\t%s\n", c)
	}
}
