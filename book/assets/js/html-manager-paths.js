// Loaded after require.js and before embed-amd.js (see nb_ipywidgets_js in _config.yml).
// Each AMD module bundled in embed-amd.js (@jupyter-widgets/base, /controls, /html-manager,
// /html-manager/dist/libembed-amd) fetches its icon fonts from the folder of its own module
// URI, which require.js would resolve next to the page. Map all of them to the vendored
// copies in html-manager/ beside this script, whatever the page's depth.
(function () {
  var fonts = document.currentScript.src.replace(/[^/]*$/, "") + "html-manager";
  require.config({
    paths: {
      "@jupyter-widgets": fonts,
      "@jupyter-widgets/html-manager/dist": fonts,
    },
  });
})();
